# shellcheck shell=bash
# The environment overlap needs, set in ONE place. Sourced by torchrun.sh and mpirun.sh;
# source it yourself when starting processes another way:  source launch/env.sh
#
# Also defines:
#   OVERLAP_PYTHON        the interpreter to run (override with PYTHON=...)
#   OVERLAP_FORWARD_VARS  names of the variables an MPI launcher must forward to ranks
#                         on other nodes (mpirun -x NAME); only those that are set

# NVLink multicast (NVLS) stays off everywhere: NCCL's NVLS algorithms, torch symmetric
# memory and NVSHMEM would each use it, and the library's measurements and its SM budget
# for NCCL assume it is off (see docs/design.md, the SM budget).
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
# Ranks' prints arrive in order and whole when several processes share a terminal.
export PYTHONUNBUFFERED=1
# One OpenMP thread per rank unless asked otherwise: N ranks x all cores oversubscribes
# the CPU and slows the CPU reference path badly (torchrun would also print a banner).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# NCCL warnings (e.g. a fallback from NVLink) are worth seeing; INFO is too chatty.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# Open MPI refuses to run as root (containers) without both of these.
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1
    export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# Open MPI's launcher component insists on finding ssh or rsh even for ranks on this
# node only; minimal images have neither. Any program satisfies it for a local job
# (multi-node jobs need a real agent: set OMPI_MCA_plm_rsh_agent yourself).
if [ -z "${OMPI_MCA_plm_rsh_agent:-}" ] && ! command -v ssh >/dev/null 2>&1 \
        && ! command -v rsh >/dev/null 2>&1; then
    export OMPI_MCA_plm_rsh_agent=false
fi

if [ -n "${PYTHON:-}" ]; then
    OVERLAP_PYTHON="$PYTHON"
elif command -v python >/dev/null 2>&1; then
    OVERLAP_PYTHON=python
else
    OVERLAP_PYTHON=python3
fi

OVERLAP_FORWARD_VARS=()
for _v in NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS \
          PYTHONUNBUFFERED OMP_NUM_THREADS NCCL_DEBUG OMPI_ALLOW_RUN_AS_ROOT \
          OMPI_ALLOW_RUN_AS_ROOT_CONFIRM PATH LD_LIBRARY_PATH PYTHONPATH VIRTUAL_ENV \
          CUDA_VISIBLE_DEVICES MASTER_ADDR MASTER_PORT TRITON_INTERPRET \
          NCCL_SOCKET_IFNAME NCCL_IB_DISABLE NCCL_MAX_CTAS NCCL_MIN_CTAS CUDA_MODULE_LOADING; do
    if [ -n "${!_v+x}" ]; then
        OVERLAP_FORWARD_VARS+=("$_v")
    fi
done
unset _v

# overlap_entry ENTRY [ARGS...] -> OVERLAP_ENTRY=(...) : "file.py args" or "-m module args"
overlap_entry() {
    if [ "$#" -lt 1 ]; then
        echo "missing ENTRY (a python file, or -m module)" >&2
        return 2
    fi
    if [ "$1" = "-m" ]; then
        if [ "$#" -lt 2 ]; then
            echo "-m needs a module name" >&2
            return 2
        fi
        OVERLAP_ENTRY=(-m "${@:2}")
    else
        if [ ! -f "$1" ]; then
            echo "ENTRY '$1' is not a file (use -m for a module)" >&2
            return 2
        fi
        OVERLAP_ENTRY=("$@")
    fi
}
