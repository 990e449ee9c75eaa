#!/usr/bin/env bash
# Usage: bash launch/torchrun.sh NPROC ENTRY [ARGS...]
#   NPROC  processes on this node (one per GPU; on a CPU-only machine any number, gloo)
#   ENTRY  a python file, or -m module
#
#   bash launch/torchrun.sh 2 launch/gpt_block_demo.py --hidden 1024
#   bash launch/torchrun.sh 8 -m mypkg.train --tp 8
#
# One node (default): torchrun --standalone picks a free rendezvous port itself.
# Several nodes: run the same command on every node with
#   NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0's address> [MASTER_PORT=29500] \
#     bash launch/torchrun.sh 8 ENTRY ...
# Extra torchrun options go in TORCHRUN_ARGS; the interpreter in PYTHON.
set -euo pipefail

if [ "$#" -lt 2 ]; then
    sed -n '2,14p' "$0" >&2
    exit 2
fi
NPROC="$1"
shift
case "$NPROC" in
    '' | *[!0-9]* | 0) echo "NPROC must be a positive integer, got '$NPROC'" >&2; exit 2 ;;
esac

# shellcheck source=env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
overlap_entry "$@"

NNODES="${NNODES:-1}"
if [ "$NNODES" -gt 1 ]; then
    : "${NODE_RANK:?NODE_RANK must be set when NNODES > 1}"
    : "${MASTER_ADDR:?MASTER_ADDR (node 0 address) must be set when NNODES > 1}"
    rdzv=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR"
          --master-port "${MASTER_PORT:-29500}")
else
    rdzv=(--standalone)
fi

# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of options
exec "$OVERLAP_PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" "${rdzv[@]}" \
    ${TORCHRUN_ARGS:-} "${OVERLAP_ENTRY[@]}"
