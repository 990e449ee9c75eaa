"""GPU check of a new M every call on R ranks, under torchrun: all_gather_matmul (one
weight and a list, return_gathered on every other call), all_reduce_matmul (residual
and LayerNorm, one weight and a list), matmul_reduce_scatter and matmul_all_reduce
(residual) on the NCCL transport, with M drawn at random from
1 to 6000 rows (M/R for the all-gather), bf16, both B layouts, fresh inputs every call,
each against torch. The calls of one row bucket (``policies.plan_rows``) share a plan: the
plans made are counted against the buckets drawn, and the blocking agreement checks
against the keys they are made once per (``row_bucket`` of M, the chunk count, the weights). A CUDA graph captured at one M of a
warm bucket replays correctly with new inputs. Prints ``PASS random_m world=R`` on success."""

from __future__ import annotations

import os
import random
import sys

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap import dist  # noqa: E402
from tests.gpu._mode import exit_if_shared  # noqa: E402
from overlap.ops import Norm, OverlapConfig  # noqa: E402
from overlap.ops import _runtime  # noqa: E402
from overlap.ops import all_gather as agmod  # noqa: E402
from overlap.ops import all_reduce as armod  # noqa: E402
from overlap.ops import matmul_reduce as mrmod  # noqa: E402
from overlap.policies import plan_rows, row_bucket  # noqa: E402

M_MAX, CALLS = 6000, 40


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    dist.init()
    exit_if_shared("random_m_check.py", "the NCCL transport with a new M every call")
    world, rank = tdist.get_world_size(), tdist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(99)  # the same weights and inputs on every rank
    rng = random.Random(5)  # the same M on every rank
    k, n, n2 = 1024, 768, 256
    gathers = [0]
    real = _runtime.gather_ints

    def counting(*a, **kw):
        gathers[0] += 1
        return real(*a, **kw)

    _runtime.gather_ints = counting
    rt = _runtime.get_runtime(_runtime.resolve_group(None), dev)
    cfg = OverlapConfig(transport="nccl", check="sync")
    norm = Norm("layernorm", torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5,
                torch.randn(k, device=dev, dtype=torch.bfloat16))
    for layout in ("wt", "kn"):
        lin = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) / k ** 0.5
        lin2 = torch.randn(n2, k, device=dev, dtype=torch.bfloat16, generator=g) / k ** 0.5
        b, b2 = (lin.t(), lin2.t()) if layout == "wt" else (lin.t().contiguous(), lin2.t().contiguous())
        plans0 = (len(agmod._plans(rt)), len(armod._plans(rt)), len(mrmod._plans(rt)))
        keys0 = [set(mod._plans(rt).keys()) for mod in (agmod, armod, mrmod)]
        # the producer ops: every rank's own K/R columns and weight rows
        kp = 512
        wp = torch.randn(world, n, kp, device=dev, dtype=torch.bfloat16, generator=g) / (world * kp) ** 0.5
        bp = wp[rank].t() if layout == "wt" else wp[rank].t().contiguous()
        checks0 = gathers[0]
        ms_seen, m_seen = set(), set()
        for call in range(CALLS):
            m = rng.randint(1, M_MAX) if call > 1 else (1, M_MAX)[call]
            ms = max(1, m // world)
            many = call % 3 == 2
            # all-gather -> GEMM
            full = torch.randn(world * ms, k, device=dev, dtype=torch.bfloat16, generator=g)
            a = full[rank * ms:(rank + 1) * ms].contiguous()
            out = agmod.all_gather_matmul(a, [b, b2] if many else b, return_gathered=call % 2 == 1, config=cfg)
            cs, gathered = out if call % 2 == 1 else (out, None)
            if gathered is not None:
                assert torch.equal(gathered, full), ("gathered", layout, call, ms)
            for c, w in zip(cs if many else [cs], (b, b2)):
                want = full @ w
                assert c.shape == want.shape, ("agmm shape", c.shape, want.shape)
                assert rel(c, want) < 1e-2, ("agmm", layout, call, ms, rel(c, want))
            ms_seen.add(ms)
            # all-reduce (+ residual, LayerNorm) -> GEMM; every rank's partial sums differ
            parts = torch.randn(world, m, k, device=dev, dtype=torch.bfloat16, generator=g)
            res = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            out = armod.all_reduce_matmul(parts[rank].contiguous(), [b, b2] if many else b, residual=res,
                                          norm=norm, config=cfg)
            cs, h = out
            h_want = parts.float().sum(0).to(torch.bfloat16).float() + res.float()
            y = torch.nn.functional.layer_norm(h_want, (k,), norm.weight.float(), norm.bias.float())
            assert rel(h, h_want) < 1e-2, ("armm h", layout, call, m, rel(h, h_want))
            for c, w in zip(cs if many else [cs], (b, b2)):
                assert c.shape == (m, w.shape[1]), ("armm shape", c.shape)
                assert rel(c, y @ w.float()) < 2e-2, ("armm", layout, call, m, rel(c, y @ w.float()))
            m_seen.add(m)
            # GEMM -> reduce-scatter, GEMM -> all-reduce (+ residual): M a multiple of R
            mp = ms * world
            xs = torch.randn(world, mp, kp, device=dev, dtype=torch.bfloat16, generator=g)
            want = sum(xs[r].float() @ wp[r].float().t() for r in range(world))
            got = mrmod.matmul_reduce_scatter(xs[rank].contiguous(), bp, config=cfg)
            mine = want[rank * ms:(rank + 1) * ms]
            assert got.shape == mine.shape and rel(got, mine) < 2e-2, ("mmrs", layout, call, mp, rel(got, mine))
            resp = torch.randn(mp, n, device=dev, dtype=torch.bfloat16, generator=g)
            got = mrmod.matmul_all_reduce(xs[rank].contiguous(), bp, residual=resp, config=cfg)
            assert got.shape == (mp, n) and rel(got, want + resp.float()) < 2e-2, ("mmar", layout, call, mp)
        made = (len(agmod._plans(rt)) - plans0[0], len(armod._plans(rt)) - plans0[1],
                len(mrmod._plans(rt)) - plans0[2])
        # one plan per bucket and weight list (and per layout: these are new weights' plans
        # only through their launches; the op plans are shared across layouts)
        ag_buckets = len({plan_rows(x) for x in ms_seen})
        ar_buckets = len({plan_rows(x) for x in m_seen})
        # every plan made is a bucket's (its rows a bucket's top), not one of the Ms drawn
        tops = ({plan_rows(x) for x in ms_seen}, {plan_rows(x) for x in m_seen},
                {plan_rows(x) * world for x in ms_seen} | {plan_rows(x * world) for x in ms_seen})
        assert any(plan_rows(x) != x for x in ms_seen), "no M off its bucket's top: nothing tested"
        for mod, k0, top in zip((agmod, armod, mrmod), keys0, tops):
            rows = {key[1] for key in mod._plans(rt).keys() if key not in k0}
            assert rows <= top, (mod.__name__, sorted(rows - top)[:5], "plans made for an M, not its bucket")
        # the reduce-scatter's buckets are per destination (M/R), the all-reduce's of M
        mp_buckets = len({plan_rows(x) for x in ms_seen}) + len({plan_rows(x * world) for x in ms_seen})
        assert made[0] <= 2 * ag_buckets and made[1] <= 2 * ar_buckets and made[2] <= mp_buckets, \
            (made, ag_buckets, ar_buckets, mp_buckets)
        # the agreement is checked once per key: M by its power-of-two bucket, the chunk
        # count (the bucket plan's), one weight or the list
        checks = gathers[0] - checks0
        keys = (len({(row_bucket(x), agmod._default_chunks(plan_rows(x))) for x in ms_seen})
                + len({(row_bucket(x), armod._default_chunks(plan_rows(x))) for x in m_seen})
                + len({(row_bucket(x * world), mrmod._default_chunks(plan_rows(x))) for x in ms_seen})
                + len({(row_bucket(x * world), mrmod._default_chunks(plan_rows(x * world))) for x in ms_seen}))
        assert checks <= 2 * keys, ("blocking checks", checks, keys)
        if rank == 0:
            print(f"{layout}: {CALLS} calls, agmm plans {made[0]} for {ag_buckets} buckets of {len(ms_seen)} M/R, "
                  f"armm plans {made[1]} for {ar_buckets} buckets of {len(m_seen)} M, producer plans {made[2]} for "
                  f"{mp_buckets} buckets of M/R, {checks} blocking checks", flush=True)
    # a CUDA graph of a call at an M of a warm bucket, replayed with new inputs
    m = 1000
    ms = m // world
    x = torch.empty(ms, k, device=dev, dtype=torch.bfloat16)
    for _ in range(2):  # eager: the exact shape warm (the capture requires it)
        x.copy_(torch.randn(ms, k, device=dev, dtype=torch.bfloat16, generator=g))
        agmod.all_gather_matmul(x, b, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        c_g = agmod.all_gather_matmul(x, b, config=cfg)
    torch.cuda.current_stream().wait_stream(side)
    for it in range(3):
        full = torch.randn(world * ms, k, device=dev, dtype=torch.bfloat16, generator=g)
        x.copy_(full[rank * ms:(rank + 1) * ms])
        graph.replay()
        torch.cuda.synchronize()
        assert rel(c_g, full @ b) < 1e-2, ("graph replay", it, rel(c_g, full @ b))
    _runtime.gather_ints = real
    tdist.barrier()
    print(f"PASS random_m world={world} rank={rank}", flush=True)
    dist.shutdown()


if __name__ == "__main__":
    main()
