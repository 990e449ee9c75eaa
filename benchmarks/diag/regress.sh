#!/usr/bin/env bash
# Before / after on one GPU, in one job: regress.py from each tree in turn (before, after,
# before, after), then each tree's one-GPU tests of the chain and the reduce kernel.
#   bash benchmarks/diag/regress.sh BEFORE_TREE OUT_DIR
# BEFORE_TREE: an older checkout (e.g. `git archive <commit> | tar -x -C DIR`); the current
# tree is "after". Logs and regress_*.json go to OUT_DIR. REGRESS_TESTS=0 skips the tests.
set -uo pipefail
before="$(cd "$1" && pwd)"
out="$2"
after="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$out"
for round in 0 1; do
    for label in before after; do
        tree=$before; [ "$label" = after ] && tree=$after
        PYTHONPATH="$tree" timeout 240 python "$after/benchmarks/diag/regress.py" --label "$label" \
            --round "$round" --out "$out" >> "$out/regress.log" 2>&1 || echo "$label $round rc=$?" >> "$out/regress.log"
    done
done
[ "${REGRESS_TESTS:-1}" = 0 ] && exit 0
for label in before after; do
    tree=$before; [ "$label" = after ] && tree=$after
    (cd "$tree" && PYTHONPATH="$tree" timeout 300 python -m pytest -q -p no:cacheprovider -m "gpu and not gpu2" \
        tests/gpu/test_chain_gpu.py tests/gpu/test_reduce_gpu.py > "$out/tier_$label.log" 2>&1;
     echo "rc=$?" >> "$out/tier_$label.log")
done
