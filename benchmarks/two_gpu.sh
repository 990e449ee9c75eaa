#!/usr/bin/env bash
# The 2-GPU run, phase by phase, each phase sized for one device call of at most 10 minutes.
#   bash benchmarks/two_gpu.sh PHASE OUT_DIR
# PHASE:
#   tier    the GPU tier, gpu and gpu2 tests (torchrun and mpirun launchers inside)
#   suite   the benchmark suite with the tuners: agmm, armm, mmrs, mmar, mmarmm, agmm3, chain
#   block   one GPT block forward + backward at TP 2: plain, library, regather, compiled modes
#           (sequence parallel) and plain / library (not), at hidden 8192 and 12288
#   train   train_gpt.py at TP 2 (sequence parallel, overlap and plain) and one process, the
#           loss curves side by side
# Logs, JSON and PNGs go under OUT_DIR/PHASE/. Every step is guarded by `timeout`, so a phase
# ends inside its budget with what it has; the exit status is that of the last failing step.
set -uo pipefail
phase="${1:?phase: tier, suite, block or train}"
out="${2:?output directory}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
dir="$out/$phase"
mkdir -p "$dir"
rc=0
step() {  # step NAME SECONDS CMD...: run CMD under a timeout, log to DIR/NAME.log
    local name="$1" secs="$2"
    shift 2
    echo "== $name ($(date -u +%H:%M:%S), at most ${secs} s): $*" | tee -a "$dir/steps.log"
    timeout "$secs" "$@" > "$dir/$name.log" 2>&1
    local r=$?
    echo "== $name rc=$r" | tee -a "$dir/steps.log"
    [ "$r" = 0 ] || rc=$r
}
case "$phase" in
    tier)
        step tier 560 python -m pytest -q -p no:cacheprovider -m "gpu or gpu2" tests/gpu --durations=30 ;;
    suite)
        step suite_consumer 280 bash launch/torchrun.sh 2 benchmarks/run.py --ops agmm,armm,agmm3 --out "$dir/consumer"
        step suite_producer 280 bash launch/torchrun.sh 2 benchmarks/run.py --ops mmrs,mmar,mmarmm,chain \
            --out "$dir/producer" ;;
    block)
        for embd in 8192 12288; do
            heads=$((embd / 128))
            step "block_sp_$embd" 140 bash launch/torchrun.sh 2 benchmarks/bench_block.py --sp --seq 4096 \
                --embd "$embd" --heads "$heads" --out "$dir/sp_$embd"
            step "block_$embd" 100 bash launch/torchrun.sh 2 benchmarks/bench_block.py --seq 4096 --embd "$embd" \
                --heads "$heads" --modes plain,library --out "$dir/nosp_$embd"
        done ;;
    train)
        common=(--steps 200 --batch 16 --block 256 --n-layer 4 --n-head 16 --n-embd 1024 --log-every 50)
        step train_tp2_overlap 180 bash launch/torchrun.sh 2 launch/train_gpt.py --tp 2 --sp --path overlap \
            "${common[@]}" --out "$dir/tp2_overlap"
        step train_tp2_plain 180 bash launch/torchrun.sh 2 launch/train_gpt.py --tp 2 --sp --path plain \
            "${common[@]}" --out "$dir/tp2_plain"
        step train_single 180 python launch/train_gpt.py "${common[@]}" --out "$dir/single" ;;
    *)
        echo "unknown phase '$phase' (tier, suite, block, train)" >&2
        exit 2 ;;
esac
# machine paths out of the logs before they are committed
find "$dir" -name '*.log' -exec sed -i "s#$repo/##g" {} +
exit "$rc"
