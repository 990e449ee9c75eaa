"""One rank of the two-GPU check of overlap.dist.nccl_comm (run by test_nccl_comm.py).

    bash launch/torchrun.sh 2 tests/gpu/nccl_comm_check.py
    bash launch/mpirun.sh   2 tests/gpu/nccl_comm_check.py

Makes the library's NCCL communicator over the tp group (default config and
NcclConfig(max_ctas=8)) and checks all_gather, all_reduce and reduce_scatter of bf16 and
fp32 tensors against torch.distributed's own result on the same group. Inputs change per
rank and per call, and outputs start as NaN, so neither stale data nor an unwritten buffer
can pass. Rank 0 prints the versions as one JSON line ("VERSIONS {...}") and
"PASS nccl_comm launcher=<launcher>" at the end.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap import dist  # noqa: E402
from tests.gpu._mode import exit_if_shared  # noqa: E402

CALLS = 4
# all_gather and reduce_scatter copy or sum identically to torch's NCCL for two ranks;
# the tolerance covers a different reduction order with more ranks.
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float32: dict(atol=1e-5, rtol=1e-5)}
_gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
_rscatter = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor


def versions(ctx: dist.DistContext) -> dict[str, object]:
    from overlap import _nccl

    try:
        import cupy

        cupy_version = cupy.__version__
    except ImportError:
        cupy_version = None
    return {
        "launcher": ctx.launch.launcher,
        "world_size": ctx.world_size,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "overlap_nccl": str(_nccl.nccl_version()),
        "checked_nccl": list(_nccl.check_nccl_versions()),
        "cupy": cupy_version,
        "gpu": torch.cuda.get_device_name(ctx.device),
    }


def main() -> int:
    from overlap._nccl import NcclConfig

    ctx = dist.init(timeout_s=120)
    exit_if_shared("nccl_comm_check.py", "overlap.dist.nccl_comm itself")
    assert ctx.backend == "nccl" and ctx.device.type == "cuda", ctx
    if ctx.is_main:
        print("VERSIONS " + json.dumps(versions(ctx)), flush=True)
    n, r, group = ctx.tp_size, ctx.tp_rank, ctx.tp_group
    comms = {"default": dist.nccl_comm(), "max_ctas=8": dist.nccl_comm(config=NcclConfig(max_ctas=8))}
    assert dist.nccl_comm() is comms["default"]
    failures = []
    for name, comm in comms.items():
        assert (comm.nranks, comm.rank) == (n, r), (name, comm.nranks, comm.rank)
        for dtype in (torch.bfloat16, torch.float32):
            for call in range(CALLS):
                g = torch.Generator(device=ctx.device).manual_seed(1000 * call + 10 * ctx.rank + 1)
                rows, cols = 64 * (call + 1), 1024  # the size changes too
                x = torch.randn(rows, cols, generator=g, device=ctx.device).to(dtype) + ctx.rank
                big = torch.randn(n * rows, cols, generator=g, device=ctx.device).to(dtype)
                got_ag = torch.full((n * rows, cols), float("nan"), device=ctx.device, dtype=dtype)
                got_ar = torch.full_like(x, float("nan"))
                got_rs = torch.full_like(x, float("nan"))
                torch.cuda.synchronize()  # inputs ready whatever stream the comm uses
                comm.all_gather(x, got_ag)
                comm.all_reduce(x, got_ar)
                comm.reduce_scatter(big, got_rs)
                torch.cuda.synchronize()

                want_ag = torch.empty_like(got_ag)
                _gather(want_ag, x, group=group)
                want_ar = x.clone()
                tdist.all_reduce(want_ar, group=group)
                want_rs = torch.empty_like(x)
                _rscatter(want_rs, big, group=group)
                torch.cuda.synchronize()
                where = f"{name} {str(dtype).removeprefix('torch.')} call {call}"
                if not torch.equal(got_ag, want_ag):
                    failures.append(f"all_gather {where}")
                for op, got, want in (("all_reduce", got_ar, want_ar), ("reduce_scatter", got_rs, want_rs)):
                    try:
                        torch.testing.assert_close(got, want, **TOL[dtype])
                    except AssertionError as exc:
                        failures.append(f"{op} {where}: {str(exc).splitlines()[0]}")
    for f in failures:
        print(f"rank {ctx.rank} FAIL {f}", flush=True)
    bad = torch.tensor([len(failures)], device=ctx.device)
    tdist.all_reduce(bad)
    if ctx.is_main and bad.item() == 0:
        print(f"PASS nccl_comm launcher={ctx.launch.launcher} world={ctx.world_size} "
              f"comms={list(comms)} calls={CALLS}", flush=True)
    dist.shutdown()
    return 0 if bad.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
