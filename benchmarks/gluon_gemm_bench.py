"""The warp-specialized Gluon GEMM (``overlap.kernels.gluon_gemm``) on one GPU: checks, then timings.

    python benchmarks/gluon_gemm_bench.py [--out DIR] [--rounds 5] [--max-seconds S] [--checks-only]
        [--variants A,B] [--shapes MxNxK:layout:dtype,...] [--chunks 4|ops]

Checks (``checks``; each raises on a wrong result):
  * fresh inputs every call, outputs poisoned with NaN first; bf16 and fp16; B as ``w.t()``
    and row-major [K, N]; ragged M, N, K and segments of C rows that are not whole tiles
    (masked stores), two A sources; 128x256 and 256x128 tiles. The error against an fp32
    reference is bounded by twice torch's own (``torch.mm`` in the same dtype) plus 1e-3.
  * tiles that wait: flags already at the epoch; flags set late, by another stream, after
    that stream has written the rows the tiles read (a tile that read early reads the
    last call's rows and fails), and the GEMM's time shows it waited; a flag never set
    -> error word code 1 with the flag's index, expected and seen values, within its
    timeout; a flag two epochs ahead -> code 2.
Timings (``timings``), CUDA-graph replays, rounds interleaved, medians: cuBLAS
(``torch.mm``); the tile GEMM alone (``launch_gemm``, the sweep's tuned config where it
has one, else 128x256x64 s3 w8 flat) and as the consumer ops run it (the per-tile
kernel over a table of 4 chunks whose flags are already set, or ``--chunks ops``: the ops'
own count, 1 to 4 by M; ``wait_ms``); the Gluon GEMM alone and waiting on a table of its own
tile over the same chunks, each of ``VARIANTS`` (the row's ``gluon_best`` names the fastest),
and waiting with tiles from a dispatch counter (``DYNAMIC_VARIANTS``, the counter zeroed per
call). ``--shapes`` times other shapes than ``SHAPES``.

Writes ``gluon_gemm.json`` (context, checks, rows, summary).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SWEEP = "benchmarks/results/2026-12-02_1xH200_36d04e5/gemm_sweep.json"
"""The tuned sweep whose configs the tile GEMM runs with here (the last full sweep)."""

# (M, N, K, B layout, dtype): 8 of the sweep's 48 (its slowest and a spread), 3 it never saw
SHAPES = [
    (8192, 12288, 6144, "kn", "bfloat16"), (16384, 6144, 4096, "nk", "bfloat16"),
    (8192, 3696, 8192, "nk", "float16"), (2048, 1536, 4096, "nk", "float16"),
    (1024, 9216, 6144, "nk", "bfloat16"), (4096, 10752, 3584, "nk", "bfloat16"),
    (2048, 8192, 14784, "nk", "bfloat16"), (32768, 6144, 8192, "kn", "bfloat16"),
    (4096, 5120, 5120, "nk", "bfloat16"), (6144, 13824, 5120, "nk", "bfloat16"),
    (3072, 7168, 2560, "kn", "bfloat16"),
]
VARIANTS = {  # name: GluonGemmConfig fields
    "128x256": dict(block_m=128, block_n=256, stages=3),
    "256x128": dict(block_m=256, block_n=128, stages=3),
    "128x128": dict(block_m=128, block_n=128, stages=4),
    "pp128x128": dict(block_m=128, block_n=128, stages=5, pingpong=True),
    "pp64x256": dict(block_m=64, block_n=256, stages=4, pingpong=True),
    "128x192": dict(block_m=128, block_n=192, stages=4),
    "128x256r4": dict(block_m=128, block_n=256, stages=4, tma_epilogue=False),
    "128x256+": dict(block_m=128, block_n=256, stages=3, ahead=True),
    "256x128+": dict(block_m=256, block_n=128, stages=3, ahead=True),
    "pp128x128+": dict(block_m=128, block_n=128, stages=5, pingpong=True, ahead=True),
    "128x192+": dict(block_m=128, block_n=192, stages=4, ahead=True),
    "128x256r4+": dict(block_m=128, block_n=256, stages=4, tma_epilogue=False, ahead=True),
    "128x256s": dict(block_m=128, block_n=256, stages=3, split_tail=True),
    "256x128s": dict(block_m=256, block_n=128, stages=3, split_tail=True),
    "128x128s": dict(block_m=128, block_n=128, stages=4, split_tail=True),
}
"""The configs checked and timed: both MMA warpgroups on one tile, (``pp``) ping-pong, a
192-column tile as two accumulators (``GluonGemmConfig.wide``), and (``r4``) C stored from
registers with a fourth ring slot in the C tile's room (``GluonGemmConfig.tma_epilogue``), and
(``+``) the reads at tile boundaries moved off the tiles' path (``GluonGemmConfig.ahead``: the
loader's next table row read a tile early and no second wait on a flag passed, the MMA warps'
error-word read in a tile's first K step), and (``s``) the last wave's tiles split along K
where it is at most half full (``GluonGemmConfig.split_tail``)."""
DYNAMIC_VARIANTS = ("128x256", "pp128x128", "128x192", "128x256+", "pp128x128+", "128x192+", "128x256s")
"""The configs also checked, and timed waiting, with the dispatch counter (``counter=``)."""


def _b(w: Any, layout: str) -> Any:
    return w.t().contiguous() if layout == "kn" else w.t()


def _close(c: Any, a: Any, b: Any, rows: Any, what: str) -> float:
    """max |c - ref| over ``rows`` must be <= 2 x torch's own error + 1e-3; returns it."""
    import torch

    ref = a.float() @ b.float()
    own = (torch.mm(a, b).float() - ref).abs().max().item()
    got = (c[rows].float() - ref[rows]).abs().max().item() if c.dtype.is_floating_point else math.inf
    if not got <= 2 * own + 1e-3:  # NaN fails too
        raise AssertionError(f"{what}: max error {got:.3e} vs torch's {own:.3e}")
    return got


def _table(segments: list[Any], n: int, bm: int, bn: int) -> Any:
    import torch

    from overlap.policies import build_tile_table

    return torch.tensor(build_tile_table(segments, n, bm, bn), dtype=torch.int32, device="cuda")


def check_plain(log: list[str], variants: dict[str, dict[str, Any]] = VARIANTS) -> None:
    """Fresh inputs, poisoned outputs, both layouts and dtypes, ragged edges, two A sources."""
    import torch

    from overlap.kernels.gluon_gemm import GluonGemmConfig, launch_gluon_gemm
    from overlap.policies import Segment

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = [(1000, 1000, 1000), (384, 512, 256), (777, 264, 136)]
    for name, fields in variants.items():
        cfg = GluonGemmConfig(**fields)
        bm, bn = cfg.block_m, cfg.block_n
        for dt in (torch.bfloat16, torch.float16):
            for lay in ("nk", "kn"):
                for m, n, k in cases:
                    # C rows from two A sources in segments that are not whole tiles
                    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=300), Segment(a_src=1, a_row=0, c_row=300,
                                                                                   rows=m - 300 - 77),
                            Segment(a_src=0, a_row=300, c_row=m - 77, rows=77)]
                    if m < 400:
                        segs = [Segment(a_src=0, a_row=0, c_row=0, rows=m)]
                    table = _table(segs, n, bm, bn)
                    for it in range(3):  # new inputs each call: a stale read fails
                        a = torch.randn(m, k, device="cuda", dtype=dt)
                        a2 = torch.randn(m, k, device="cuda", dtype=dt)
                        w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
                        b = _b(w, lay)
                        c = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
                        launch_gluon_gemm(a, b, c, table, grid=min(sms, 7 + it), a2=a2 if m >= 400 else None,
                                          config=cfg)
                        torch.cuda.synchronize()
                        a_full = a if m < 400 else torch.cat([a[:300], a2[:m - 377], a[300:377]])
                        _close(c, a_full, b, slice(None), f"plain {name} {dt} {lay} {m}x{n}x{k} call {it}")
    log.append(f"plain {', '.join(variants)}: {len(variants) * 2 * 2 * len(cases) * 3} calls right "
               "(fresh inputs, NaN-poisoned C)")


def check_waits(log: list[str], variants: dict[str, dict[str, Any]] = VARIANTS) -> None:
    """Flags already set; set late by another stream after its writes; never set; ahead."""
    import torch

    from overlap.kernels.gluon_gemm import GluonGemmConfig, launch_gluon_gemm
    from overlap.policies import Segment

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m, n, k, chunks = 2048, 2048, 1024, 4
    rows = m // chunks
    for name, fields in variants.items():
        cfg = GluonGemmConfig(**fields)
        bm, bn = cfg.block_m, cfg.block_n
        segs = [Segment(a_src=0, a_row=i * rows, c_row=i * rows, rows=rows, wait_idx=i) for i in range(chunks)]
        table = _table(segs, n, bm, bn)
        flags = torch.zeros(chunks + 1, dtype=torch.int32, device="cuda")
        err = torch.zeros(8, dtype=torch.int32, device="cuda")
        side = torch.cuda.Stream()
        a = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        b = w.t()
        epoch = 0
        # flags already set
        for it in range(3):
            epoch += 1
            a.normal_()
            flags[:chunks].fill_(epoch)
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            launch_gluon_gemm(a, b, c, table, grid=sms, flags=flags, err=err, epoch=epoch, config=cfg)
            torch.cuda.synchronize()
            assert int(err[0]) == 0, f"set flags: error word {err.tolist()}"
            _close(c, a, b, slice(None), f"set flags {name} call {it}")
        # set late by another stream, after it wrote the rows (copy engine), chunk by chunk; the
        # last two calls on 4 programs, whose next tiles mostly wait on the flag of the last
        # (GluonGemmConfig.ahead waits once per such run)
        waited = []
        for it, grid in enumerate((sms - 8, sms - 8, sms - 8, 4, 4)):
            epoch += 1
            fresh = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ep = torch.full((chunks,), epoch, dtype=torch.int32, device="cuda")
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for i in range(chunks):
                    torch.cuda._sleep(2_000_000)  # about 1 ms at 1.98 GHz
                    a[i * rows:(i + 1) * rows].copy_(fresh[i * rows:(i + 1) * rows])
                    flags[i:i + 1].copy_(ep[i:i + 1])
            s0.record()
            # SMs left to the side stream's kernels (a grid of every SM spinning would hold them)
            launch_gluon_gemm(a, b, c, table, grid=grid, flags=flags, err=err, epoch=epoch, config=cfg)
            s1.record()
            torch.cuda.synchronize()
            assert int(err[0]) == 0, f"late flags: error word {err.tolist()}"
            _close(c, fresh, b, slice(None), f"late flags {name} call {it}")
            waited.append(s0.elapsed_time(s1))
        if not min(waited) > 2.0:
            raise AssertionError(f"late flags {name}: the GEMM took {waited} ms; the flags came after ~4 ms, "
                                 "so its tiles did not wait")
        # never set: a bounded wait, then the error word; C NaN over the chunk never set and
        # right or NaN elsewhere (never C's old values: it starts at 7)
        for grid in (sms, 4):
            err.zero_()
            epoch += 1
            a.normal_()
            flags[:chunks].fill_(epoch)
            flags[2] = epoch - 1
            t0 = time.perf_counter()
            c = torch.full((m, n), 7.0, device="cuda", dtype=torch.bfloat16)
            launch_gluon_gemm(a, b, c, table, grid=grid, flags=flags, err=err, epoch=epoch,
                              timeout_ns=50_000_000, config=cfg)
            torch.cuda.synchronize()
            secs = time.perf_counter() - t0
            e = err.tolist()
            assert e[0] == 1 and e[2] == 2 and e[3] == epoch and e[4] == epoch - 1, f"never set: error word {e}"
            assert secs < 5.0, f"never set: the kernel took {secs:.2f} s to give up (timeout 50 ms)"
            assert torch.isnan(c[2 * rows:3 * rows]).all(), f"never set {name} grid {grid}: numbers without data"
            want = a.float() @ b.float()
            ok = torch.isnan(c) | ((c.float() - want).abs() <= 0.05 + 0.02 * want.abs())
            assert ok.all(), f"never set {name} grid {grid}: neither NaN nor the result (old values?)"
        # two epochs ahead: code 2
        err.zero_()
        epoch += 1
        flags[:chunks].fill_(epoch)
        flags[1] = epoch + 2
        launch_gluon_gemm(a, b, c, table, grid=sms, flags=flags, err=err, epoch=epoch, timeout_ns=50_000_000,
                          config=cfg)
        torch.cuda.synchronize()
        e = err.tolist()
        assert e[0] == 2 and e[2] == 1 and e[4] == epoch + 2, f"ahead: error word {e}"
        err.zero_()
        log.append(f"waits {name}: set, late (GEMM {min(waited):.1f}-{max(waited):.1f} ms, waited), never set "
                   f"(code 1 in {secs:.2f} s), ahead (code 2): right")


def check_dynamic(log: list[str], variants: dict[str, dict[str, Any]] = VARIANTS) -> None:
    """The dispatch counter: ragged segments and two A sources, fresh inputs; two launches
    (the second on another stream, as the give-back grid) sharing one table and counter,
    every tile stored once and the counter at tiles + programs (each loader's last take
    fails once), so both grids took tiles; and late flags with the counter."""
    import torch

    from overlap.kernels.gluon_gemm import GluonGemmConfig, launch_gluon_gemm
    from overlap.policies import Segment

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    side = torch.cuda.Stream()
    for name, fields in variants.items():
        cfg = GluonGemmConfig(**fields)
        bm, bn = cfg.block_m, cfg.block_n
        m, n, k = 1000, 1000, 1000
        table = _table([Segment(a_src=0, a_row=0, c_row=0, rows=300), Segment(a_src=1, a_row=0, c_row=300, rows=623),
                        Segment(a_src=0, a_row=300, c_row=923, rows=77)], n, bm, bn)
        for it in range(3):
            a, a2 = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() / k ** 0.5
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            counter = torch.zeros(1, dtype=torch.int32, device="cuda")
            launch_gluon_gemm(a, b, c, table, grid=5 + it, a2=a2, counter=counter, config=cfg)
            torch.cuda.synchronize()
            _close(c, torch.cat([a[:300], a2[:623], a[300:377]]), b, slice(None), f"dynamic {name} call {it}")
            assert int(counter) == table.shape[0] + 5 + it, (name, int(counter), table.shape[0])
        # two grids, one table and counter
        m, n, k = 4096, 4096, 1024
        table = _table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, bm, bn)
        for it in range(3):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() / k ** 0.5
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            counter = torch.zeros(1, dtype=torch.int32, device="cuda")
            side.wait_stream(torch.cuda.current_stream())
            launch_gluon_gemm(a, b, c, table, grid=sms - 32, counter=counter, config=cfg)
            with torch.cuda.stream(side):
                launch_gluon_gemm(a, b, c, table, grid=32, counter=counter, config=cfg)
            torch.cuda.synchronize()
            _close(c, a, b, slice(None), f"two grids {name} call {it}")
            assert int(counter) == table.shape[0] + sms, (name, int(counter), table.shape[0], sms)
        # late flags, tiles from the counter
        m, n, k, chunks = 2048, 2048, 1024, 4
        rows = m // chunks
        table = _table([Segment(a_src=0, a_row=i * rows, c_row=i * rows, rows=rows, wait_idx=i)
                        for i in range(chunks)], n, bm, bn)
        flags = torch.zeros(chunks, dtype=torch.int32, device="cuda")
        err = torch.zeros(8, dtype=torch.int32, device="cuda")
        a = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() / k ** 0.5
        for epoch in (1, 2):
            fresh = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ep = torch.full((chunks,), epoch, dtype=torch.int32, device="cuda")
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            counter = torch.zeros(1, dtype=torch.int32, device="cuda")
            torch.cuda.synchronize()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for i in range(chunks):
                    torch.cuda._sleep(1_000_000)
                    a[i * rows:(i + 1) * rows].copy_(fresh[i * rows:(i + 1) * rows])
                    flags[i:i + 1].copy_(ep[i:i + 1])
            launch_gluon_gemm(a, b, c, table, grid=sms - 8, flags=flags, err=err, epoch=epoch, counter=counter,
                              config=cfg)
            torch.cuda.synchronize()
            assert int(err[0]) == 0, f"dynamic late flags {name}: error word {err.tolist()}"
            _close(c, fresh, b, slice(None), f"dynamic late flags {name} epoch {epoch}")
        log.append(f"dynamic {name}: ragged + two sources, two grids on one counter, late flags: right")


def check_split(log: list[str], variants: dict[str, dict[str, Any]] = VARIANTS) -> None:
    """(``split_tail`` variants) grids whose last wave is split, each plan launched again and
    again (its arrival counts set back to 0 by each launch): fresh inputs, NaN-poisoned C,
    both B layouts, ragged edges; a flag of the tail's chunk never set (code 1, NaN over that
    chunk, right or NaN elsewhere) and the same plan right on the next call; two grids on one
    counter (the split the first launch fixed); a row cut whose dead tiles are in the tail."""
    import torch

    from overlap.kernels.gluon_gemm import GluonGemmConfig, GluonGemmPlan, split_plan
    from overlap.policies import Segment

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    side = torch.cuda.Stream()
    for name, fields in variants.items():
        cfg = GluonGemmConfig(**fields)
        if not cfg.split_tail:
            continue
        bm, bn = cfg.block_m, cfg.block_n
        calls = 0
        for (m, n, k), grid, lay in (((1000, 1000, 1000), 30, "nk"), ((1000, 1000, 1000), 12, "kn"),
                                     ((2048, 1536, 4096), sms, "nk"), ((777, 1288, 2056), sms, "kn"),
                                     ((1024, 4608, 3072), sms, "kn")):
            table = _table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, bm, bn)
            sp = split_plan(table.shape[0], grid, -(-k // cfg.block_k))
            for dt in (torch.bfloat16, torch.float16):
                a = torch.randn(m, k, device="cuda", dtype=dt)
                b = _b(torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5, lay)
                c = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
                plan = GluonGemmPlan(a, b, c, table, config=cfg)
                for it in range(3):
                    a.normal_()
                    c.fill_(float("nan"))
                    plan.launch(a, b, c, epoch=0, grid=grid)
                    torch.cuda.synchronize()
                    _close(c, a, b, slice(None), f"split {name} {m}x{n}x{k} {lay} {dt} grid {grid} call {it}")
                    calls += 1
                assert (plan.split[1] is None) == (sp is None), (plan.split, sp)
                if sp is not None:
                    assert int(plan.split[3].abs().sum()) == 0, f"split {name}: counts left {plan.split[3].tolist()}"
        # a flag never set in the tail's chunk, then the same plan again with it set
        m, n, k, chunks = 2048, 2048, 1024, 4
        rows = m // chunks
        table = _table([Segment(a_src=0, a_row=i * rows, c_row=i * rows, rows=rows, wait_idx=i)
                        for i in range(chunks)], n, bm, bn)
        grid = sms - 8
        assert split_plan(table.shape[0], grid, k // cfg.block_k) is not None, (name, table.shape[0], grid)
        flags = torch.zeros(chunks, dtype=torch.int32, device="cuda")
        err = torch.zeros(8, dtype=torch.int32, device="cuda")
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() / k ** 0.5
        c = torch.full((m, n), 7.0, device="cuda", dtype=torch.bfloat16)
        plan = GluonGemmPlan(a, b, c, table, flags=flags, err=err, timeout_ns=50_000_000, config=cfg)
        for epoch, never in ((1, None), (2, chunks - 1), (3, None), (4, 0), (5, None)):
            err.zero_()
            a.normal_()
            c.fill_(7.0)
            flags.fill_(epoch)
            if never is not None:
                flags[never] = epoch - 1
            plan.launch(a, b, c, epoch=epoch, grid=grid)
            torch.cuda.synchronize()
            want = a.float() @ b.float()
            e = err.tolist()
            if never is None:
                assert e[0] == 0, f"split {name} epoch {epoch}: error word {e}"
                _close(c, a, b, slice(None), f"split waits {name} epoch {epoch}")
            else:
                assert e[0] == 1 and e[2] == never, f"split {name} never set {never}: error word {e}"
                assert torch.isnan(c[never * rows:(never + 1) * rows]).all(), f"split {name}: numbers without data"
                ok = torch.isnan(c) | ((c.float() - want).abs() <= 0.05 + 0.02 * want.abs())
                assert ok.all(), f"split {name} never set {never}: neither NaN nor the result"
            if plan.split[1] is not None:
                assert int(plan.split[3].abs().sum()) == 0, f"split {name}: counts left {plan.split[3].tolist()}"
        # two grids on one counter, then a row cut whose dead tiles include the tail's
        m, n, k = 4096, 4096, 1024
        table = _table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, bm, bn)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() / k ** 0.5
        c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        plan = GluonGemmPlan(a, b, c, table, counter=counter, config=cfg)
        for it in range(3):
            a.normal_()
            c.fill_(float("nan"))
            counter.zero_()
            side.wait_stream(torch.cuda.current_stream())
            plan.launch(a, b, c, epoch=0, grid=sms - 32 - it)
            with torch.cuda.stream(side):
                plan.launch(a, b, c, epoch=0, grid=32)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            _close(c, a, b, slice(None), f"split two grids {name} call {it}")
        span = 1024
        table = _table([Segment(a_src=0, a_row=0, c_row=0, rows=span)], n, bm, bn)
        a = torch.randn(span, k, device="cuda", dtype=torch.bfloat16)
        c = torch.full((span, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        plan = GluonGemmPlan(a, b, c, table, config=cfg, clip=True)
        assert split_plan(table.shape[0], 120, k // cfg.block_k) is not None, (name, table.shape[0])
        for cap in (span, 700, 1000, 300, span):  # (1000: the tail's tiles cut, not dead)
            aa = torch.randn(cap, k, device="cuda", dtype=torch.bfloat16)
            cc = torch.full((cap, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            plan.launch(aa, b, cc, epoch=0, grid=120, rows=(cap, span))  # (the tail: the last row block's)
            torch.cuda.synchronize()
            _close(cc, aa, b, slice(None), f"split row cut {name} {cap} rows")
            if plan.split[1] is not None:
                assert int(plan.split[3].abs().sum()) == 0, f"split {name}: counts left {plan.split[3].tolist()}"
        log.append(f"split {name}: {calls} calls on split grids, a flag never set and the next call, two grids on "
                   "one counter, a row cut: right")


POST_VARIANTS = ("128x256", "256x128", "128x128", "128x256r4")
"""The plain kernel's configs, whose tiles may post (a producer op's: ``post=True``)."""


def check_posts(log: list[str], variants: dict[str, dict[str, Any]] = VARIANTS,
                trace: Any = None) -> None:
    """Tiles that post (``post=True``, as the producer ops' GEMM): fresh inputs, C poisoned
    with NaN, both B layouts, ragged rows, the GEMM on a dispatch counter shared by two grids
    (the second on another stream, as the give-back grid): after the launch every post flag
    holds its tile count; then, launched again behind a reader stream that waits on each
    row chunk's flags (``cuStreamWaitValue32``, as the producer ops' comm stream) and copies
    that chunk's rows of C at once, the rows it read are whole. A short count fails, never
    hangs: the reader's waits are released once the GEMM has ended and the counts are read.
    ``trace(stage)``, where given, is called before each stage (a hang then names its stage)."""
    import torch

    trace = trace or (lambda stage: None)

    from overlap import flags as _flags
    from overlap import protocol as P
    from overlap.kernels.gluon_gemm import GluonGemmConfig, launch_gluon_gemm
    from overlap.policies import Segment

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    side, give = torch.cuda.Stream(), torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    for name, fields in variants.items():
        cfg = GluonGemmConfig(**fields)
        m, n, k = 1000, 1000, 768
        bounds = [0, 256, 512, 768, m]  # four row chunks, each posting to its m-tiles' flags
        segs = [Segment(a_src=0, a_row=lo, c_row=lo, rows=hi - lo, post_base=16 * i)
                for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
        table = _table(segs, n, cfg.block_m, cfg.block_n)
        posts = table[:, P.COL_POST].long()
        want = torch.bincount(posts[posts >= 0], minlength=64)
        # (host ints: nothing is read from the GPU while the reader's stream is current and waits)
        counts = want.tolist()
        chunk_flags = [[f for f, n_f in enumerate(counts) if n_f and f // 16 == i] for i in range(4)]

        def gemm(a: Any, b: Any, c: Any, flags: Any) -> None:
            counter = torch.zeros(1, dtype=torch.int32, device="cuda")
            give.wait_stream(cur)
            launch_gluon_gemm(a, b, c, table, grid=max(1, sms // 2), flags=flags, counter=counter, config=cfg,
                              post=True)
            with torch.cuda.stream(give):  # the give-back grid on the same table and counter
                launch_gluon_gemm(a, b, c, table, grid=8, flags=flags, counter=counter, config=cfg, post=True)
            cur.wait_stream(give)

        for lay in ("nk", "kn"):
            for it in range(3):
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                b = _b(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5, lay)
                c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                flags = torch.zeros(64, dtype=torch.int32, device="cuda")
                trace(f"{name} {lay} call {it}: two grids")
                gemm(a, b, c, flags)
                torch.cuda.synchronize()
                got = flags.long().cpu()
                assert torch.equal(got, want.cpu()), f"posts {name} {lay} call {it}: flags {got.tolist()}"
                _close(c, a, b, slice(None), f"posts {name} {lay} call {it}")
                # again, behind the reader: chunk by chunk, its flags' counts then its rows
                c.fill_(float("nan"))
                flags.zero_()
                out = torch.full_like(c, float("nan"))
                torch.cuda.synchronize()
                trace(f"{name} {lay} call {it}: the reader's waits queued")
                with torch.cuda.stream(side):
                    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
                        for f in chunk_flags[i]:
                            _flags.stream_wait_value(side, flags, f, counts[f])
                        out[lo:hi].copy_(c[lo:hi])
                trace(f"{name} {lay} call {it}: two grids behind the reader")
                gemm(a, b, c, flags)
                cur.synchronize()  # the GEMM's grids ended (they wait on nothing)
                trace(f"{name} {lay} call {it}: the grids ended, the reader released")
                got = flags.long().cpu()
                if not torch.equal(got, want.cpu()):
                    # release the reader's waits (a copy from the host: no kernel while it waits), then fail
                    flags.copy_(torch.tensor(counts, dtype=torch.int32))
                    torch.cuda.synchronize()
                    raise AssertionError(f"posts {name} {lay} call {it} behind the reader: flags {got.tolist()}")
                torch.cuda.synchronize()
                _close(out, a, b, slice(None), f"posts {name} {lay} call {it}: rows read after their flags")
        # a row cut (a row bucket's plan): the table made for 512 rows, this call's 300; the
        # tiles past row 300 store nothing and still count
        span, cap = 512, 300
        table = _table([Segment(a_src=0, a_row=0, c_row=0, rows=span, post_base=0)], n, cfg.block_m, cfg.block_n)
        posts = table[:, P.COL_POST].long()
        want = torch.bincount(posts[posts >= 0], minlength=64)
        a = torch.randn(cap, k, device="cuda", dtype=torch.bfloat16)
        b = _b(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5, "nk")
        c = torch.full((cap, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        flags = torch.zeros(64, dtype=torch.int32, device="cuda")
        trace(f"{name}: a row cut")
        launch_gluon_gemm(a, b, c, table, grid=sms, flags=flags, config=cfg, post=True, rows=(cap, span))
        torch.cuda.synchronize()
        assert torch.equal(flags.long().cpu(), want.cpu()), f"posts {name} row cut: flags {flags.tolist()}"
        _close(c, a, b, slice(None), f"posts {name} row cut")
        log.append(f"posts {name}: every flag at its tile count, rows read after their flag whole, two grids "
                   "on one counter, dead tiles of a row cut counted: right")


def checks(variants: dict[str, dict[str, Any]] = VARIANTS, posts: bool = True) -> tuple[list[str], dict[str, str]]:
    """Every variant's checks; returns the log and the variants that failed (with why)."""
    import torch

    log: list[str] = []
    failed: dict[str, str] = {}
    for name, fields in variants.items():
        print(f"checking {name}", flush=True)
        try:
            check_plain(log, {name: fields})
            check_waits(log, {name: fields})
            if name in DYNAMIC_VARIANTS and not fields.get("split_tail"):  # (check_split's own)
                check_dynamic(log, {name: fields})
            if fields.get("split_tail"):
                check_split(log, {name: fields})
            if posts and name in POST_VARIANTS:
                check_posts(log, {name: fields})
        except Exception as e:  # noqa: BLE001 - recorded; that variant is then not timed
            failed[name] = f"{type(e).__name__}: {str(e)[:1000]}"
            log.append(f"FAILED {name}: {failed[name]}")
            torch.cuda.synchronize()
    return log, failed


def _sweep_configs() -> dict[tuple, dict[str, Any]]:
    path = os.path.join(os.path.dirname(__file__), "..", SWEEP)
    try:
        with open(path) as f:
            rows = json.load(f)["rows"]
    except OSError:
        return {}
    return {(r["m"], r["n"], r["k"], r["b_layout"], r["dtype"]): r["config_fields"] for r in rows
            if r.get("config_fields")}


def parse_shapes(text: str) -> list[tuple]:
    """``--shapes``: "MxNxK:layout:dtype" items, comma-separated (layout nk or kn; dtype
    bfloat16 or float16), e.g. "512x3584x1792:nk:bfloat16,16384x6144x4096:nk:bfloat16"."""
    out = []
    for item in text.split(","):
        try:
            mnk, lay, dts = item.strip().split(":")
            m, n, k = (int(v) for v in mnk.split("x"))
        except ValueError:
            raise SystemExit(f"--shapes: {item!r} is not MxNxK:layout:dtype") from None
        if lay not in ("nk", "kn") or dts not in ("bfloat16", "float16") or min(m, n, k) <= 0:
            raise SystemExit(f"--shapes: {item!r}: layout nk or kn, dtype bfloat16 or float16, positive sizes")
        out.append((m, n, k, lay, dts))
    return out


def chunks_for(m: int, how: str) -> int:
    """Chunk flags of the waiting tables at M rows: a fixed count ("4", the default), or
    "ops": ``all_reduce_matmul``'s own policy (one per 2048 rows, 1 to 4), as
    ``gemm_sweep.py``'s ``wait_ms`` (fewer chunks at small M, where each chunk's tiles read
    all of B again)."""
    if how == "ops":
        from overlap.ops.all_reduce import _default_chunks

        return _default_chunks(m)
    return int(how)


def time_shape(shape: tuple, rounds: int, sms: int, tuned: dict[tuple, dict[str, Any]],
               variants: dict[str, dict[str, Any]] = VARIANTS, chunks: str = "4") -> dict[str, Any]:
    import dataclasses

    import torch

    from overlap.kernels.autotune import GraphTimer, _cfg_str
    from overlap.kernels.gluon_gemm import GluonGemmConfig, GluonGemmPlan
    from overlap.kernels.tile_gemm import GemmConfig, launch_gemm, launch_tile_gemm
    from overlap.policies import Segment, row_chunk_segments

    m, n, k, lay, dts = shape
    dt = getattr(torch, dts)
    g = torch.Generator(device="cuda").manual_seed(m + 3 * n + 7 * k)
    a = torch.randn(m, k, device="cuda", dtype=dt, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dt, generator=g) / k ** 0.5
    b = _b(w, lay)
    ref = torch.empty(m, n, device="cuda", dtype=dt)
    fields = tuned.get(shape)
    alone_cfg = GemmConfig(**fields) if fields else GemmConfig(num_stages=3, flatten=True)
    # the consumer ops' kernel: per tile, no flattening nor tail
    wait_cfg = dataclasses.replace(alone_cfg, flatten=False, tail_block_m=0, tail_block_n=0)
    # the row chunks as all_reduce_matmul cuts them (and gemm_sweep's wait_table): multiples
    # of 128 rows but the last
    _sizes, segs = row_chunk_segments(m, chunks_for(m, chunks), 128)
    flags = torch.ones(len(segs), dtype=torch.int32, device="cuda")  # epoch 1: already set
    err = torch.zeros(8, dtype=torch.int32, device="cuda")
    outs = {}

    def out(name: str) -> Any:
        outs[name] = torch.empty(m, n, device="cuda", dtype=dt)
        return outs[name]

    c_tile, c_tw = out("tile"), out("tile_wait")
    t_wait_table = _table(segs, n, wait_cfg.block_m, wait_cfg.block_n)
    fns = {"cublas": lambda: torch.mm(a, b, out=ref),
           "tile": lambda: launch_gemm(a, b, c_tile, grid=sms, config=alone_cfg),
           "tile_wait": lambda: launch_tile_gemm(a, b, c_tw, t_wait_table, flags=flags, err=err, epoch=1,
                                                 wait=True, grid=sms, config=wait_cfg)}
    for name, vfields in variants.items():
        gcfg = GluonGemmConfig(**vfields)
        bm, bn = gcfg.block_m, gcfg.block_n
        alone_t = _table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, bm, bn)
        wait_t = _table(segs, n, bm, bn)
        ca, cw = out(f"gluon_{name}"), out(f"gluon_wait_{name}")
        # (a plan per GEMM, as the ops hold one: made once, launched call after call; a split
        # tail's workspace is the plan's)
        pa = GluonGemmPlan(a, b, ca, alone_t, config=gcfg)
        fns[f"gluon_{name}"] = lambda pa=pa, ca=ca: pa.launch(a, b, ca, epoch=1, grid=sms)
        if name in DYNAMIC_VARIANTS:
            cd = out(f"gluon_dynwait_{name}")
            ctr = torch.zeros(1, dtype=torch.int32, device="cuda")
            pd = GluonGemmPlan(a, b, cd, wait_t, flags=flags, err=err, counter=ctr, config=gcfg)
            # the counter zeroed per call (a memset, as the consumer ops do for the tile GEMM)
            fns[f"gluon_dynwait_{name}"] = (lambda pd=pd, cd=cd, ctr=ctr: (
                ctr.zero_(), pd.launch(a, b, cd, epoch=1, grid=sms)))
        pw = GluonGemmPlan(a, b, cw, wait_t, flags=flags, err=err, config=gcfg)
        fns[f"gluon_wait_{name}"] = lambda pw=pw, cw=cw: pw.launch(a, b, cw, epoch=1, grid=sms)
    timers = {}
    errors = {}
    for name, fn in fns.items():
        try:
            timers[name] = GraphTimer(fn)
        except Exception as e:  # noqa: BLE001 - one engine failing is recorded, the others timed
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
            torch.cuda.synchronize()
    times: dict[str, list[float]] = {kk: [] for kk in timers}
    for _ in range(rounds):
        for kk, t in timers.items():
            times[kk].append(t.ms())
    torch.cuda.synchronize()
    refd = ref.float()
    rel = {kk: ((outs[kk].float() - refd).norm() / refd.norm()).item() for kk in outs if kk in timers}
    med = {kk: statistics.median(v) for kk, v in times.items()}
    row: dict[str, Any] = {"m": m, "n": n, "k": k, "b_layout": lay, "dtype": dts, "wait_chunks": len(segs),
                           "tuned_in_sweep": bool(fields),
                           "tile_config": _cfg_str(alone_cfg), "tile_wait_config": _cfg_str(wait_cfg),
                           "ms": {kk: round(v, 5) for kk, v in med.items()}, "rel_err_vs_cublas": rel,
                           "errors": errors, "int32_err_word": err.tolist(), "times": times}
    cb = med.get("cublas")
    ga = [kk for kk in med if kk.startswith("gluon_") and not kk.startswith(("gluon_wait", "gluon_dyn"))]
    gw = [kk for kk in med if kk.startswith("gluon_wait")]
    gd = [kk for kk in med if kk.startswith("gluon_dynwait")]
    if cb:
        if "tile" in med:
            row["tile_vs_cublas"] = round(cb / med["tile"], 4)
        if "tile_wait" in med:
            row["tile_wait_vs_cublas"] = round(cb / med["tile_wait"], 4)
        if ga:
            best = min(ga, key=lambda kk: med[kk])
            row["gluon_best"] = best
            row["gluon_vs_cublas"] = round(cb / med[best], 4)
        if gw:
            best = min(gw, key=lambda kk: med[kk])
            row["gluon_wait_best"] = best
            row["gluon_wait_vs_cublas"] = round(cb / med[best], 4)
        if gd:
            best = min(gd, key=lambda kk: med[kk])
            row["gluon_dynwait_best"] = best
            row["gluon_dynwait_vs_cublas"] = round(cb / med[best], 4)
    return row


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("tile_vs_cublas", "tile_wait_vs_cublas", "gluon_vs_cublas", "gluon_wait_vs_cublas",
                "gluon_dynwait_vs_cublas"):
        v = [r[key] for r in rows if r.get(key)]
        if v:
            out[key] = {"geomean": round(math.exp(sum(map(math.log, v)) / len(v)), 4), "min": min(v),
                        "max": max(v), "shapes": len(v)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-seconds", type=float, default=None)
    ap.add_argument("--checks-only", action="store_true")
    ap.add_argument("--checks-from", default=None,
                    help="a --checks-only JSON of this code from the same machine: its checks, not run again")
    ap.add_argument("--variants", default=None, help="comma-separated names of VARIANTS to check and time")
    ap.add_argument("--no-posts", action="store_true", help="leave out the checks of tiles that post")
    ap.add_argument("--commit", default=None, help="the commit of the code that runs, where the checkout's is not")
    ap.add_argument("--shapes", default=None, help="the shapes to time instead of SHAPES: MxNxK:layout:dtype,...")
    ap.add_argument("--chunks", default="4", help="chunk flags of the waiting tables: a count, or 'ops' "
                    "(all_reduce_matmul's: one per 2048 rows, 1 to 4)")
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    if args.chunks != "ops" and not (args.chunks.isdigit() and int(args.chunks) >= 1):
        raise SystemExit(f"--chunks must be a positive count or 'ops', got {args.chunks!r}")
    t_start = time.perf_counter()
    import torch

    if not torch.cuda.is_available():
        sys.exit("gluon_gemm_bench.py runs on a CUDA GPU; none is visible here")
    from benchmarks.context import run_context
    from overlap.kernels import gluon_gemm

    os.makedirs(args.out, exist_ok=True)
    context = run_context()
    context.update({"gluon": gluon_gemm.AVAILABLE, "gluon_reason": gluon_gemm.REASON, "rounds": args.rounds,
                    "timing": "CUDA-graph replays, rounds interleaved, medians", "tuned_configs_from": SWEEP,
                    "variants": VARIANTS, "posts_checked": not args.no_posts, "wait_chunks": args.chunks})
    if args.commit:
        context["checkout_commit"], context["commit"] = context.get("commit"), args.commit
    doc: dict[str, Any] = {"context": context, "checks": [], "check_failed": {}, "rows": [], "not_run": []}

    def save() -> None:
        doc["summary"] = summary(doc["rows"])
        with open(os.path.join(args.out, "gluon_gemm.json"), "w") as f:
            json.dump(doc, f, indent=1)

    variants = VARIANTS if not args.variants else {kk: VARIANTS[kk] for kk in args.variants.split(",")}
    if args.checks_from:
        with open(args.checks_from) as f:
            prior = json.load(f)
        doc["checks"], doc["check_failed"] = prior["checks"], prior["check_failed"]
        # (relative to --out where it lies under it: no machine's paths in the results)
        doc["checks_from"] = os.path.relpath(args.checks_from, args.out)
    else:
        doc["checks"], doc["check_failed"] = checks(variants, posts=not args.no_posts)
    for line in doc["checks"]:
        print("CHECK", line, flush=True)
    save()
    if args.checks_only:
        return
    checked = " ".join(doc["checks"])
    good = {kk: v for kk, v in variants.items() if kk not in doc["check_failed"] and f"waits {kk}:" in checked}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tuned = _sweep_configs()
    for i, shape in enumerate(shapes):
        if args.max_seconds is not None and time.perf_counter() - t_start > args.max_seconds:
            doc["not_run"] = [list(s) for s in shapes[i:]]
            print(f"--max-seconds spent: {len(shapes) - i} shapes not run", flush=True)
            break
        r = time_shape(shape, args.rounds, sms, tuned, good, args.chunks)
        doc["rows"].append(r)
        print(f"[{i + 1}/{len(shapes)}] {shape}: ms {r['ms']} | tile {r.get('tile_vs_cublas')} tile_wait "
              f"{r.get('tile_wait_vs_cublas')} gluon {r.get('gluon_vs_cublas')} ({r.get('gluon_best')}) gluon_wait "
              f"{r.get('gluon_wait_vs_cublas')} | errors {r['errors']} [{time.perf_counter() - t_start:.0f} s]",
              flush=True)
        save()
    save()
    print(json.dumps(doc["summary"], indent=1), flush=True)


if __name__ == "__main__":
    main()
