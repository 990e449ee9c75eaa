"""GPU correctness of all_reduce_matmul on R ranks (run under torchrun or mpirun).

Every call gets fresh inputs (a tile reading a chunk before it landed would
read the last call's rows and fail), chunkings that do not divide M, with and
without a residual, LayerNorm and RMSNorm (also folded into the GEMM), both B
layouts, fp16 and bf16, many epochs, the chunked baseline, and a timeout that must raise instead of hanging
(one rank skips its all-reduce). Prints ``PASS armm <launcher>`` on success.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap import dist  # noqa: E402
from tests.gpu._mode import exit_if_shared  # noqa: E402
from overlap.ops import Norm  # noqa: E402
from overlap.ops import all_reduce as armod  # noqa: E402
from overlap.kernels.tile_gemm import GemmConfig, warp_specialize_supported  # noqa: E402
from overlap.ops._runtime import Chunked, NcclTransport, OverlapConfig, PeerCopyTransport, Sequential  # noqa: E402


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()


def main() -> None:
    ctx = dist.init()
    exit_if_shared("armm_check.py", "the NCCL transport's variants, an NCCL tuner candidate")
    world, rank = tdist.get_world_size(), tdist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    launcher = ctx.launch.launcher
    cases = [
        # (M, N, K, dtype, chunks, b_layout, residual, norm)
        (512, 256, 256, torch.bfloat16, 1, "wt", False, None),
        (1000, 384, 512, torch.bfloat16, 3, "wt", True, "layernorm"),   # M not a multiple of chunks or tiles
        (777, 256, 320, torch.float16, 4, "kn", True, None),
        (1536, 512, 2304, torch.bfloat16, 2, "kn", False, "rmsnorm"),  # K > the norm's K block
        (2048, 1024, 1024, torch.bfloat16, 4, "wt", True, "layernorm"),
        (384, 256, 12288, torch.bfloat16, 2, "wt", True, "layernorm"),  # p2p reduce: 3 K blocks of 4096
        (272, 256, 9216, torch.float16, 3, "kn", False, "rmsnorm"),    # p2p reduce: a partial last K block
    ]
    calls = 0
    for (m, n, k, dt, chunks, layout, with_res, kind) in cases:
        # (transport, give-back, norm folded, split tail: the last chunk's tiles in K pieces);
        # give-back "shared": the reduce kernel's programs beside the GEMM's on every SM;
        # "two": two-shot (each rank reduces half the rows, then pushes them), with give-back
        variants = [("nccl", True, False, 0), ("nccl", False, False, 0), ("p2p", True, False, 0),
                    ("p2p", False, False, 0), ("nccl", True, False, 4), ("p2p", True, False, 8),
                    ("p2p", "shared", False, 0), ("p2p", "two", False, 0), ("p2p", "two", False, 4)]
        if kind:  # the norm folded into the GEMM (statistics from the reduce kernel, diag(w) B)
            variants += [("p2p", True, True, 0), ("p2p", False, True, 0), ("p2p", True, True, 4),
                         ("p2p", "shared", True, 8), ("p2p", "two", True, 0), ("p2p", "two", True, 2)]
        variants = [v + (False,) for v in variants]
        if warp_specialize_supported():  # the GEMM's K loop warp-specialized
            variants += [("nccl", True, False, 0, True), ("p2p", True, False, 8, True)]
            if kind:
                variants += [("p2p", True, True, 4, True)]
        for transport, give_back, fold, split, ws in variants:
            if give_back == "two" and kind and not fold:
                continue  # two-shot with a norm folds it
            # each transport with its own options (the typed form)
            opts = (NcclTransport(ctas=8) if transport == "nccl" else
                    PeerCopyTransport(reduce_ctas=64 if give_back == "shared" else 8, fold_norm=fold,
                                      reduce_shared=give_back == "shared", two_shot=give_back == "two"))
            cfg = OverlapConfig(chunks=chunks, give_back=give_back in (True, "two"), check="sync", transport=opts,
                                split_tail=split, gemm=GemmConfig(warp_specialize=True) if ws else None)
            for it in range(5):
                g = torch.Generator(device=dev).manual_seed(10_000 * rank + 100 * it + m + chunks)
                x = torch.randn(m, k, device=dev, dtype=dt, generator=g)
                gs = torch.Generator(device=dev).manual_seed(7 + it)  # same on every rank
                res = torch.randn(m, k, device=dev, dtype=dt, generator=gs) if with_res else None
                w = torch.randn(n, k, device=dev, dtype=dt, generator=gs) / k ** 0.5
                b = w.t() if layout == "wt" else w.t().contiguous()
                norm = None
                if kind:
                    lw = (torch.rand(k, device=dev, generator=gs) + 0.5).to(dt)
                    lb = torch.randn(k, device=dev, generator=gs).to(dt) if kind == "layernorm" else None
                    norm = Norm(kind, lw, lb, 1e-5)
                x0 = x.clone()
                c, h = armod.all_reduce_matmul(x, b, residual=res, norm=norm, config=cfg)
                c_ref, h_ref = armod.all_reduce_matmul_ref(x, b, residual=res, norm=norm)
                assert torch.equal(x, x0), "x_partial was modified"
                # NCCL's sum order may differ from the reference's call: one rounding step
                assert rel(h, h_ref) < 1e-2, f"h differs: case {(m, n, k, chunks, kind)} it {it}: {rel(h, h_ref)}"
                if transport == "p2p":  # the residual stream must be the same bits on every rank
                    hs = [torch.empty_like(h) for _ in range(world)]
                    tdist.all_gather(hs, h)
                    assert all(torch.equal(hs[0], t) for t in hs), "h differs between ranks"
                y64 = h_ref.double()
                if kind == "layernorm":
                    y64 = torch.nn.functional.layer_norm(y64, (k,), norm.weight.double(), norm.bias.double(), 1e-5)
                elif kind == "rmsnorm":
                    y64 = torch.nn.functional.rms_norm(y64, (k,), norm.weight.double(), 1e-5)
                c64 = y64 @ b.double()
                e_ours, e_ref = rel(c, c64), rel(c_ref, c64)
                assert e_ours <= 2 * e_ref + 2e-3, (
                    f"rank {rank} case {(m, n, k, dt, chunks, layout, with_res, kind, fold)} it {it}: "
                    f"err {e_ours:.2e} vs torch {e_ref:.2e}")
                calls += 1
    assert armod.stats["fused"] >= calls, armod.stats
    # chunked baseline agrees too
    x = torch.randn(1024, 512, device=dev, dtype=torch.bfloat16)
    res = torch.randn(1024, 512, device=dev, dtype=torch.bfloat16)
    w = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
    norm = Norm("layernorm", torch.ones(512, device=dev, dtype=torch.bfloat16), None)
    c1, h1 = armod.all_reduce_matmul_chunked(x, w.t(), residual=res, norm=norm, chunks=3)
    c2, h2 = armod.all_reduce_matmul_ref(x, w.t(), residual=res, norm=norm)
    assert rel(h1, h2) < 1e-2 and rel(c1, c2) < 2e-2, (rel(h1, h2), rel(c1, c2))
    assert armod.stats["p2p"] >= calls // 2, armod.stats
    # many epochs on one shape, inputs changing every call; identity B: c == norm(h) exactly
    eye = torch.eye(256, device=dev, dtype=torch.bfloat16)
    for transport in ("nccl", "p2p"):
        cfg = OverlapConfig(chunks=2, check="async", transport=NcclTransport(ctas=8) if transport == "nccl" else "p2p")
        for it in range(200):
            x = torch.full((256, 256), float(it % 17 + rank), device=dev, dtype=torch.bfloat16)
            x[it % 256] += 1
            c, h = armod.all_reduce_matmul(x, eye, config=cfg)
            assert torch.equal(c, h), f"identity GEMM differs from h at call {it} ({transport})"
            want = sum(float(it % 17 + r) for r in range(world))
            assert h[(it + 1) % 256, 0].item() == want and h[it % 256, 0].item() == want + world, \
                f"stale h at call {it} ({transport})"
    # p2p back to back with no host sync, shapes alternating, checked at the end
    outs = []
    for it in range(40):
        m_i = 256 if it % 2 else 512
        x = torch.full((m_i, 256), float(it % 13 + rank), device=dev, dtype=torch.bfloat16)
        outs.append((it, m_i, armod.all_reduce_matmul(x, eye, config=OverlapConfig(chunks=2, transport="p2p"))))
    for it, m_i, (c, h) in outs:
        want = sum(float(it % 13 + r) for r in range(world))
        assert torch.equal(c, h) and bool((h == want).all()), f"back-to-back p2p call {it} differs"
    # the tuner: whatever wins, later calls of the op take that path
    x = torch.randn(1024, 512, device=dev, dtype=torch.bfloat16)
    w = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
    best = armod.tune_all_reduce_matmul(x, w.t(), candidates=[OverlapConfig(chunks=2, nccl_ctas=16)], iters=3)
    before = dict(armod.stats)
    c, h = armod.all_reduce_matmul(x, w.t())
    moved = {k for k in armod.stats if armod.stats[k] != before[k]}
    want = ({"sequential_by_tuner", "reference"} if isinstance(best, Sequential)
            else {"chunked_by_tuner", "chunked"} if isinstance(best, Chunked) else {"fused"})
    assert moved == want, (best, moved)
    c_ref, _ = armod.all_reduce_matmul_ref(x, w.t())
    assert rel(c, c_ref) < 2e-2
    # a provoked timeout: on rank 0 alone, each chunk's "all-reduce" is a
    # 0.2 s sleep on the comm stream (a slow peer); the GEMM's 50 ms bound
    # must expire and raise, never hang
    torch.cuda.synchronize()
    tdist.barrier()
    if rank == 0:
        from overlap.flags import FlagTimeoutError
        from overlap.ops._runtime import get_runtime, resolve_group

        rt = get_runtime(resolve_group(None), dev)
        saved = rt.comm

        class _NoComm:
            def all_reduce(self, send, recv, op="sum", stream=None):
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(400_000_000)

        rt.comm = lambda ctas: _NoComm()
        try:
            armod.all_reduce_matmul(torch.randn(256, 256, device=dev, dtype=torch.bfloat16), eye,
                                    config=OverlapConfig(chunks=2, nccl_ctas=8, check="sync", timeout_ms=50))
        except FlagTimeoutError as e:
            assert e.rank == 0 and e.flag_idx in (0, 1), e
        else:
            raise AssertionError("timeout was not reported")
        finally:
            rt.comm = saved
    # p2p: rank 1's pushes come ~0.2 s late each; rank 0's reduce kernel must time out
    # (50 ms) and the op raise, not hang; rank 1 (default bound) completes
    from overlap.flags import FlagTimeoutError as _FTE
    from overlap.ops._runtime import get_runtime, resolve_group
    from tests.gpu._late import late_pushes

    torch.cuda.synchronize()
    tdist.barrier()
    cfg = OverlapConfig(chunks=2, check="sync", transport="p2p", timeout_ms=50 if rank == 0 else 5000)
    with late_pushes(rank == 1):
        try:
            armod.all_reduce_matmul(torch.randn(256, 256, device=dev, dtype=torch.bfloat16), eye, config=cfg)
        except _FTE as e:
            # the reduce kernel's wait on the peers' flags (slot 0, chunk 0 or 1; expected the
            # call's epoch), not the GEMM's wait on a counted ready flag (epoch * programs)
            ep = get_runtime(resolve_group(None), dev).p2p().flags("all_reduce_matmul", 1).epoch
            assert rank == 0 and e.rank == 0 and e.flag_idx in (0, 1) and e.expected == ep, (e, ep)
        else:
            assert rank != 0, "p2p timeout was not reported"
    torch.cuda.synchronize()
    tdist.barrier()
    if rank == 0:
        print(f"PASS armm {launcher} world={world} calls={calls} stats={armod.stats}", flush=True)
    dist.shutdown()


if __name__ == "__main__":
    main()
