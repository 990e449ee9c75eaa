#!/usr/bin/env bash
# Usage: bash launch/shared_gpu.sh RANKS [--mps] [--out DIR] [--only CASES] [--budget-s S]
#   RANKS  ranks on the one GPU (2, or more where memory allows)
#   --mps  start an MPS daemon for the run (private pipe/log dirs under /tmp), stop it after
#
# Runs the multi-rank GPU checks with RANKS ranks sharing GPU 0 (shared-GPU mode:
# OVERLAP_SHARED_GPU=1; gloo, the peer-copy transport, no NCCL) and writes
# DIR/shared_gpu.json and DIR/shared_gpu.log. Cases: ops, guarantees, refusals, producer_p2p_check,
# layers, kill, train (train_gpt.py --tp RANKS against one process). Times are not
# performance figures. See docs/guarantees.md.
set -euo pipefail

if [ "$#" -lt 1 ]; then
    sed -n '2,10p' "$0" >&2
    exit 2
fi
# shellcheck source=env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OVERLAP_SHARED_GPU=1
exec "$OVERLAP_PYTHON" "$(dirname "${BASH_SOURCE[0]}")/shared_gpu.py" "$@"
