#!/usr/bin/env bash
# Usage: bash launch/mpirun.sh NP ENTRY [ARGS...]
#   NP     ranks (one per GPU; on a CPU-only machine any number, gloo)
#   ENTRY  a python file, or -m module
#
#   bash launch/mpirun.sh 2 launch/gpt_block_demo.py
#   bash launch/mpirun.sh 2 -m mypkg.bench --size 8192
#
# Ranks run under `python -m mpi4py`, so an uncaught exception on one rank aborts the
# whole job instead of leaving the others waiting in a collective.
#
# One node (default). Several nodes (Open MPI): list them in a hostfile, e.g.
#   node0 slots=8
#   node1 slots=8
# and run  HOSTFILE=hosts bash launch/mpirun.sh 16 ENTRY ...  on node 0. The variables
# in launch/env.sh are forwarded with -x; overlap.dist.init() picks rank 0's address
# (or MASTER_ADDR if set) for its store. Extra mpirun options go in MPIRUN_ARGS, the
# launcher in MPIRUN (default mpirun), the interpreter in PYTHON.
set -euo pipefail

if [ "$#" -lt 2 ]; then
    sed -n '2,19p' "$0" >&2
    exit 2
fi
NP="$1"
shift
case "$NP" in
    '' | *[!0-9]* | 0) echo "NP must be a positive integer, got '$NP'" >&2; exit 2 ;;
esac

# shellcheck source=env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
overlap_entry "$@"

MPIRUN="${MPIRUN:-mpirun}"
if ! command -v "$MPIRUN" >/dev/null 2>&1; then
    echo "$MPIRUN not found: apt-get install openmpi-bin libopenmpi-dev (then pip install 'overlap[mpi]')" >&2
    exit 127
fi

args=(-np "$NP")
if "$MPIRUN" --version 2>&1 | grep -q "Open MPI"; then
    # No core binding: each rank drives a GPU plus NCCL's proxy thread; binding them to one
    # core each (Open MPI's default for np <= 2) starves those threads.
    args+=(--bind-to none)
    if [ -n "${HOSTFILE:-}" ]; then
        args+=(--hostfile "$HOSTFILE")
    elif [ "$NP" -gt "$(nproc)" ]; then
        args+=(--oversubscribe)  # more ranks than cores: fine for the CPU path
    fi
    for v in "${OVERLAP_FORWARD_VARS[@]}"; do
        args+=(-x "$v")
    done
else
    # MPICH / Intel MPI (Hydra) forward the whole environment by default.
    if [ -n "${HOSTFILE:-}" ]; then
        args+=(-f "$HOSTFILE")
    fi
fi

# shellcheck disable=SC2086  # MPIRUN_ARGS is a list of options
exec "$MPIRUN" "${args[@]}" ${MPIRUN_ARGS:-} "$OVERLAP_PYTHON" -m mpi4py "${OVERLAP_ENTRY[@]}"
