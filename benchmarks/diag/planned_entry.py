"""The Python cost of a planned call's entry, up to its plan graph's replay, on the CPU.

    python benchmarks/diag/planned_entry.py [agmm|armm+ln|mmarmm+ln]     # the second: a cProfile too
    REPO=/path/to/another/tree python benchmarks/diag/planned_entry.py

``all_gather_matmul``, ``all_reduce_matmul`` and ``matmul_all_reduce_matmul`` (+ residual,
LayerNorm) at 512 x 1024 x 1024, bf16, from the public function down to ``_graphs._replay`` (replaced here by a
function that returns at once): the group's call step, the call plans' index, the
alignment and autograd checks, the graph's pick. Runs on a CPU (one gloo rank): CPU
tensors are made to say they are on CUDA (``torch.Tensor.is_cuda``, for this process),
the runtime and the call plan are stand-ins, so only the library's Python is timed, not
a driver call. ``REPO`` picks the tree to import (before / after runs). Prints the median
of five rounds of 20,000 calls per op.
"""

import os
import sys
import threading
import timeit
from types import SimpleNamespace

sys.path.insert(0, os.environ.get("REPO", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + os.getpid() % 300), RANK="0", WORLD_SIZE="1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    torch.Tensor.is_cuda = property(lambda self: True)  # the planned path's first look
    from overlap.ops import Norm, OverlapConfig, _calls, _graphs
    from overlap.ops import all_gather as ag, all_reduce as ar, boundary as bd

    _graphs._replay = lambda rt, cp, body, pg, args: "out"

    def setup(mod, op, key_fn, args, moving) -> None:  # noqa: ANN001
        rt = Runtime.__new__(Runtime)
        rt._caches = {}
        rt.transport = lambda cfg: "nccl"
        rt.order = SimpleNamespace(lock=threading.RLock())
        mod.get_runtime_if_made = lambda g_, d: rt
        cfg = OverlapConfig()
        cp = _calls.CallPlan(op, (), (), None, (), (1, 1, 1), "nccl", "stand-in", cfg, "nccl")
        st = _graphs.GraphState(True)
        st.graph = SimpleNamespace(graph=object(), relay=None, ptrs=_graphs._fixed_ptrs(args, moving))
        cp.body = SimpleNamespace(moving=moving, flops=1, gstate=st)
        _calls.keep(rt, key_fn(cfg), cp)

    from overlap.ops._runtime import Runtime

    dt = torch.bfloat16
    a, w = torch.randn(512, 1024, dtype=dt), torch.randn(1024, 1024, dtype=dt)
    b = w.t()
    x, res = torch.randn(512, 1024, dtype=dt), torch.randn(512, 1024, dtype=dt)
    norm = Norm("layernorm", torch.randn(1024, dtype=dt), torch.randn(1024, dtype=dt))
    setup(ag, "all_gather_matmul", lambda cfg: ag._call_key(a, b, False, cfg, "nccl", False, None), (a, b), (0,))
    setup(ar, "all_reduce_matmul", lambda cfg: ar._call_key(x, b, res, norm, cfg, "nccl", False, None),
          (x, b, res, norm), (0, 2))
    b2 = torch.randn(1024, 1024, dtype=dt).t()
    setup(bd, bd.OP, lambda cfg: bd._call_key(a, b, b2, res, norm, cfg, False, None), (a, b, b2, res, norm), (0, 3))
    cases = {"agmm": lambda: ag.all_gather_matmul(a, b),
             "armm+ln": lambda: ar.all_reduce_matmul(x, b, residual=res, norm=norm),
             "mmarmm+ln": lambda: bd.matmul_all_reduce_matmul(a, b, b2, residual=res, norm=norm)}
    for name, fn in cases.items():
        assert fn() == "out", f"{name}: the call did not reach its replay"
        n = 20000
        ts = sorted(timeit.repeat(fn, number=n, repeat=5))
        print(f"{name:10s} {ts[2] / n * 1e6:6.2f} us up to the replay (median of 5 x {n})")
    if len(sys.argv) > 1:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20000):
            cases[sys.argv[1]]()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
