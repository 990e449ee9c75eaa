#!/usr/bin/env bash
# What has been built and tested on the CPU but not yet run on a GPU, checked and timed on one
# GPU in one job:
#   bash benchmarks/diag/gpu_pending.sh OUT_DIR [STEP_PREFIX ...]
# (with prefixes, only the steps whose names start with one: e.g. `nodes_unit check_nodes host_`).
# All of it takes more than 10 minutes on an H200 host; where one command is bounded by that,
# run it in parts, most telling first:
#   1. gluon_split_tests gluon_split_slow    (GluonGemmConfig.split_tail, passed on an H100
#                                             at 647fcbc: its checks, the Gluon tests
#                                             of plain and waiting tiles with its variants among
#                                             them; then timed against the same configs without
#                                             it on the shapes with a partial last wave); then
#                                             gluon_split_bench, and the sweep with
#                                             OVERLAP_GLUON_EXPERIMENTAL=1 (sweep_split)
#   2. sweep_x                               (the 48-shape sweep, about 1-8 minutes)
#   3. gluon_wide_bench                      (the posting kernel's checks included)
#   4. post_diag reader_steps nodes_unit check_ host_ launch
# (ran on an H100 at d42acfd: every Gluon GPU test, gluon_ahead_*, gluon_native, sweep_warm,
# sweep_x: benchmarks/results/2026-12-05_1xH100_d42acfd/; ahead and the warm-up gave nothing.)
# (post_diag, nodes_unit, host_, launch, the Gluon tests but posts, gluon_wide_bench without
# posts and sweep_x ran at a0823fb on an H200: benchmarks/results/2026-12-05_1xH200_a0823fb/;
# the test of posts, post_diag's posting cases, gluon_producer, gluon_planned_x and
# gluon_ops_bench passed or ran at 2000b13 on an H100: 2026-12-05_1xH100_2000b13/; check_,
# planned_gluon, gluon_chain and gluon_chain_graph at 5b10c0b.)
# The three ways a plan graph copies its activations in and outputs out (OVERLAP_PLAN_GRAPH_COPIES):
# 1. the memcpy-node machinery alone (tests/gpu/test_driver_gpu.py, its host times printed);
# 2. plan_graphs_check.py with each kind of copies (nodes, driver, graph): the five group ops
#    and the chain, new inputs every call, earlier outputs unchanged, moved weights, two streams;
# 3. host_overhead.py for the ops, nodes / driver / graph / nodes (the first kind again last, so
#    a drift of the machine over the run shows), each in OUT_DIR/host_<kind><n>/, then the default
#    with --alternate (the first activation's node updated every call) in OUT_DIR/host_alt/;
# 4. plan_graph_launch.py (each step of a replayed call, each kind's whole call);
# The Gluon GEMM:
# 5. planned_check.py --engine gluon: the bound bodies with the Gluon GEMM's launches bound;
# 6. chain_check.py --engine gluon: mlp_chain's fc2 forced onto the Gluon GEMM; chain_graph.py at
#    two row counts: the chain (fc2 on the engine it measured) against torch and stream sync;
# 7. post_diag: each experimental Gluon part alone in a bounded process (benchmarks/diag/
#    gluon_post_diag.py, `check_posts` per variant among them), then reader_steps (what a
#    stream wait's flag not yet set blocks: a kernel's first launch on another stream, on the
#    waiting one); the Gluon GEMM's GPU tests, the posts', the
#    192-column tile and C from registers among them (its kernel alone, waiting, by
#    the dispatch counter; the engine plan on a table retiled to it), then gluon_gemm_bench.py
#    timing 128x256, ping-pong 128x128, 128x192 and 128x256 on 4 stages with C from registers on
#    its eleven shapes against cuBLAS;
# 8. with OVERLAP_GLUON_EXPERIMENTAL=1: the producer ops and the block boundary with the Gluon
#    GEMM forced (its tiles' posts: producer_check.py at world size 1, planned_check.py), and
#    engine_ops_bench.py, auto (the 192-column tile and posts among the candidates) against tile;
# 9. the 48-shape GEMM sweep as users get it (the engine's default candidates, the posts among
#    them; wait_ms on the engine; post_ms: the producer ops' GEMM on the engine; alone_best),
#    new shapes started for 480 s.
# 10. GluonGemmConfig.ahead (not yet run on a GPU): the Gluon GPU tests of tiles that
#    wait (its `+` variants among them, static and by the dispatch counter, and the engine plan
#    forced onto it with row cuts, the give-back grid, a flag never set, a graph), then
#    gluon_gemm_bench.py timing 128x256, 256x128 and ping-pong 128x128 with and without it;
#    then the engine with OVERLAP_GLUON_AHEAD=1 (every candidate with it): engine_ops_bench.py
#    (the ops at world size 1, by the dispatch counter; without it first) and the 48-shape sweep
#    (to set beside sweep_x's).
# Every step is bounded (timeout) and logged to OUT_DIR/<step>.log; a failed step does not stop
# the others. NCCL_NVLS_ENABLE=0 as launch/env.sh sets it.
set -uo pipefail
mkdir -p "$1" || exit 1
out="$(cd "$1" && pwd)"  # (absolute: the steps run from the repository's root)
shift
prefixes=()
for p in "$@"; do [ -n "$p" ] && prefixes+=("$p"); done  # (an empty prefix: ignored)
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo" || exit 1
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2 p
    shift 2
    if [ ${#prefixes[@]} -gt 0 ]; then
        for p in "${prefixes[@]}"; do [[ $name == "$p"* ]] && break; p=; done
        [ -z "$p" ] && return 0
    fi
    echo "== $name: $*" > "$out/$name.log"
    timeout -k 15 "$secs" "$@" >> "$out/$name.log" 2>&1
    echo "rc=$?" >> "$out/$name.log"
    tail -n 1 "$out/$name.log" | sed "s/^/$name /"
}
step post_diag 400 python benchmarks/diag/gluon_post_diag.py --ptx --bound 20
step reader_steps 60 python benchmarks/diag/gluon_post_diag.py --cases reader_steps --bound 20
step nodes_unit 120 python -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_driver_gpu.py
for kind in nodes driver graph; do
    step "check_$kind" 300 python tests/gpu/plan_graphs_check.py --copies "$kind"
done
ops="torch.mm,all_gather_matmul,all_reduce_matmul + layernorm,matmul_reduce_scatter,matmul_all_reduce"
ops="$ops,matmul_all_reduce_matmul + layernorm,mlp_chain"
n=0
for kind in nodes driver graph nodes; do
    n=$((n + 1))
    step "host_$kind$n" 300 python benchmarks/host_overhead.py --copies "$kind" --calls 300 --no-graph-rows \
        --only "$ops" --out "$out/host_$kind$n"
done
# (no call's first activation where the last call's was: its memcpy node updated per call)
step host_alt 300 python benchmarks/host_overhead.py --alternate --calls 300 --no-graph-rows --only "$ops" \
    --out "$out/host_alt"
step launch 300 python benchmarks/diag/plan_graph_launch.py --out "$out/launch"
step planned_gluon 300 python tests/gpu/planned_check.py --engine gluon
step gluon_chain 300 python tests/gpu/chain_check.py --engine gluon
step gluon_chain_graph 300 python benchmarks/chain_graph.py --rows 512,2048 --rounds 3 --max-seconds 200 \
    --out "$out/chain_graph"
step gluon_wide_tests 400 python -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_gluon_gemm_gpu.py
step gluon_wide_bench 400 python benchmarks/gluon_gemm_bench.py --out "$out/gluon_wide" \
    --variants 128x256,pp128x128,128x192,128x256r4 --rounds 3 --max-seconds 300
step gluon_ahead_tests 400 python -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_gluon_gemm_gpu.py \
    -k "tiles_wait or dispatch_counter or ahead"
step gluon_ahead_bench 400 python benchmarks/gluon_gemm_bench.py --out "$out/gluon_ahead" --no-posts \
    --variants 128x256,128x256+,256x128,256x128+,pp128x128,pp128x128+ --rounds 3 --max-seconds 300
step gluon_ahead_ops0 300 python benchmarks/engine_ops_bench.py --out "$out/engine_ops_without"
step gluon_ahead_ops1 300 env OVERLAP_GLUON_AHEAD=1 python benchmarks/engine_ops_bench.py --out "$out/engine_ops_ahead"
step gluon_ahead_sweep 590 env OVERLAP_GLUON_AHEAD=1 python benchmarks/gemm_sweep.py --out "$out/sweep_ahead" \
    --posts --max-seconds 480
# the seven shapes that waited under 0.93x in the 48-shape sweep (a0823fb), each Gluon variant on
# a table of its own tile over the ops' chunks: does a native table close them?
worst="512x3584x1792:nk:bfloat16,512x4096x1024:kn:bfloat16,2048x12288x4096:kn:bfloat16"
worst="$worst,4096x10752x3584:nk:bfloat16,8192x3696x8192:nk:float16,16384x6144x4096:nk:bfloat16"
worst="$worst,1024x6144x768:nk:bfloat16"
step gluon_native 400 python benchmarks/gluon_gemm_bench.py --out "$out/gluon_native" --no-posts --chunks ops \
    --shapes "$worst" --variants 128x256,256x128,128x128,pp128x128,128x192,128x256+,pp128x128+ --rounds 3 \
    --max-seconds 330
# GluonGemmConfig.split_tail: its checks, then timed against the same configs without it on the
# bench's eleven shapes and on the sweep's shapes under 0.93x on H100 and H200 (ops' chunks)
step gluon_split_tests 300 python -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_gluon_gemm_gpu.py \
    -k "split or matches or tiles_wait or guarantees"
step gluon_split_bench 330 python benchmarks/gluon_gemm_bench.py --out "$out/gluon_split" --no-posts \
    --variants 128x256,128x256s,256x128,256x128s,128x128,128x128s,pp128x128 --rounds 3 --max-seconds 280
slow="$worst,1024x9216x6144:nk:bfloat16,2048x1536x4096:nk:float16,1024x18944x3584:kn:bfloat16"
slow="$slow,1024x6144x4096:kn:bfloat16,32768x2368x3584:nk:float16,2048x4096x1024:nk:bfloat16"
step gluon_split_slow 330 python benchmarks/gluon_gemm_bench.py --out "$out/gluon_split_slow" --no-posts \
    --chunks ops --shapes "$slow" --variants 128x256,128x256s,256x128,256x128s,128x128,128x128s,pp128x128 \
    --rounds 3 --max-seconds 280
step sweep_split 590 env OVERLAP_GLUON_EXPERIMENTAL=1 python benchmarks/gemm_sweep.py --out "$out/sweep_split" \
    --posts --max-seconds 480
# the engine's picks after a warm-up of about 150 ms (engine.WARM_MS), to set beside sweep_x's
step sweep_warm 590 python benchmarks/gemm_sweep.py --out "$out/sweep_warm" --posts --max-seconds 480 \
    --engine-warm-ms 150
step gluon_producer 300 env OVERLAP_GLUON_EXPERIMENTAL=1 OVERLAP_GEMM_ENGINE=gluon python tests/gpu/producer_check.py
step gluon_planned_x 300 env OVERLAP_GLUON_EXPERIMENTAL=1 python tests/gpu/planned_check.py --engine gluon
step gluon_ops_bench 300 env OVERLAP_GLUON_EXPERIMENTAL=1 python benchmarks/engine_ops_bench.py \
    --out "$out/engine_ops"
step sweep_x 590 python benchmarks/gemm_sweep.py --out "$out/sweep_x" --posts \
    --max-seconds 480
