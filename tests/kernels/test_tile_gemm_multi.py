"""One grid over the GEMMs of several weights that read the same A rows (Q, K, V; gate,
up): the interleaved tile table as logic, the kernel with 2 and 3 weights of different N
under the Triton interpreter, a weight's tiles held by their chunk's flag, the launch's
refusals, and (where Triton's ptxas is installed) the sm_90 build: a one-weight kernel
carries no other weight's descriptor.

The interpreted tests run in a child process with TRITON_INTERPRET=1 (``tests._interp``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from overlap import protocol as P
from overlap.policies import (Segment, all_gather_layout, all_gather_push_layout, build_multi_tile_table,
                              build_tile_table)
from tests._interp import interpreted

NS = [48, 16, 32]  # three weights of different N (3, 1 and 2 column tiles of 16)


def _layouts():
    for world in (1, 2, 3):
        for rank in range(world):
            for chunks in (1, 2, 3):
                yield all_gather_layout(world, rank, 37, chunks, 16)
                yield all_gather_push_layout(world, rank, 37, chunks, 16, flag_stride=8)


def test_interleaved_table_order() -> None:
    """Chunk-major: each run of tiles waiting on one flag holds every weight's tiles of those
    rows, weight 0's first, before any tile of the next flag; every tile of every weight
    once; a weight's waits and its tiles' order those of its own table."""
    for lay in _layouts():
        t = build_multi_tile_table(lay.segments, NS, 16, 16, group_m=2, array=True)
        w = t[:, P.COL_N_TILE] >> P.N_TILE_BITS
        flag = t[:, P.COL_WAIT]
        # flag runs in the segments' order, each run's weights ascending (non-decreasing)
        seg_flags = [s.wait_idx for s in lay.segments]
        runs = [f for i, f in enumerate(seg_flags) if i == 0 or f != seg_flags[i - 1]]
        got_runs = [int(f) for i, f in enumerate(flag) if i == 0 or f != flag[i - 1]]
        assert got_runs == runs, (got_runs, runs)
        for f in runs:
            ws = w[flag == f]
            assert (np.diff(ws) >= 0).all() and set(ws.tolist()) == set(range(len(NS))), (f, ws)
        for i, n in enumerate(NS):
            own = build_tile_table(lay.segments, n, 16, 16, group_m=2, array=True)
            mine = t[w == i].copy()
            mine[:, P.COL_N_TILE] &= P.N_TILE_MASK
            # the same tiles, in the same order, with the same waits and multipliers
            assert np.array_equal(mine, own), (lay, i)
        assert len(t) == sum(len(build_tile_table(lay.segments, n, 16, 16, array=True)) for n in NS)
    one = all_gather_layout(2, 0, 37, 2, 16).segments
    assert np.array_equal(build_multi_tile_table(one, [48], 16, 16, 2, array=True),
                          build_tile_table(one, 48, 16, 16, 2, array=True))


def test_interleaved_table_refuses() -> None:
    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=32, post_base=0)]
    with pytest.raises(ValueError, match="cannot post"):
        build_multi_tile_table(segs, [16, 32], 16, 16)
    with pytest.raises(ValueError, match="column counts"):
        build_multi_tile_table([Segment(0, 0, 0, 32)], [], 16, 16)
    with pytest.raises(ValueError, match="column tiles"):
        build_multi_tile_table([Segment(0, 0, 0, 32)], [16, 16 << P.N_TILE_BITS], 16, 16)


@interpreted
def test_multi_weight_kernel() -> None:
    """2 and 3 weights of different N in one grid, both B layouts, fp16 and fp32, partial
    tiles, two grid sizes and a shuffled table: every C against torch; a split tail."""
    from tests.kernels._interp_common import CFG, CFG32, TOL, _rel
    from overlap.kernels.tile_gemm import launch_tile_gemm, split_workspace
    from overlap.policies import split_tail

    g = torch.Generator().manual_seed(21)
    for dt in (torch.float16, torch.float32):
        for ns in (NS[:2], NS, [16, 64]):
            m, k = 40, 32
            a = torch.randn(m, k, generator=g).to(dt)
            ws = [torch.randn(n, k, generator=g).to(dt) for n in ns]
            tab = torch.tensor(build_multi_tile_table([Segment(0, 0, 0, m)], ns, 16, 16, 2), dtype=torch.int32)
            perm = torch.randperm(tab.shape[0], generator=g)
            for layout in ("wt", "kn"):
                bs = [w.t() if layout == "wt" else w.t().contiguous() for w in ws]
                for t, grid in ((tab, 3), (tab[perm].contiguous(), 5)):
                    cs = [torch.full((m, n), float("nan"), dtype=dt) for n in ns]
                    launch_tile_gemm(a, bs, cs, t, grid=grid, config=CFG)
                    for i, (c, w) in enumerate(zip(cs, ws)):
                        assert not torch.isnan(c).any(), (dt, ns, i, "an element was not written")
                        assert _rel(c, a.double() @ w.double().t()) < TOL[dt], (dt, ns, layout, i)
    # the last tiles split along K: pieces of another weight's tiles sum into that weight's C
    m, k = 64, 64
    a = torch.randn(m, k, generator=g).half()
    ws = [torch.randn(n, k, generator=g).half() for n in NS]
    rows = build_multi_tile_table([Segment(0, 0, 0, m)], NS, 32, 16, 2, array=True)
    rows, start = split_tail(rows, 5, 2)
    tab = torch.tensor(rows, dtype=torch.int32)
    cs = [torch.full((m, n), float("nan")).half() for n in NS]
    launch_tile_gemm(a, [w.t() for w in ws], cs, tab, grid=4, config=CFG32, split=(start, 2),
                     counter=torch.zeros(1 + 5, dtype=torch.int32),
                     workspace=split_workspace((start, 2), tab.shape[0], CFG32, "cpu"))
    for c, w in zip(cs, ws):
        assert _rel(c, a.double() @ w.double().t()) < TOL[torch.float16]


@interpreted
def test_weight_tiles_wait_for_their_chunk() -> None:
    """Every weight's tiles of a chunk wait on its flag: with new rows every call, chunk 1's
    rows and flag land from another thread while the grid runs; a tile that read before its
    flag would read the previous call's rows. A flag that never comes: those tiles of every
    weight are NaN and the error names the flag."""
    import threading
    import time

    from tests.kernels._interp_common import CFG, ErrorWord, FlagTimeoutError, TOL, _rel
    from overlap.kernels.tile_gemm import launch_tile_gemm

    g = torch.Generator().manual_seed(22)
    world, ms, k = 2, 32, 32
    lay = all_gather_layout(world, 0, ms, 2, 16)  # chunks of 16 rows; flags 0, 1
    tab = torch.tensor(build_multi_tile_table(lay.segments, NS, 16, 16, 2), dtype=torch.int32)
    # the same tiles with the last weight's first: the interpreter runs programs one after
    # another, so in the table's order weight 0's first wait on chunk 1 would hold the later
    # weights' tiles back even if theirs did not wait; here they reach chunk 1 first
    w_of = tab[:, P.COL_N_TILE] >> P.N_TILE_BITS
    rev = tab[torch.sort(-w_of, stable=True).indices].contiguous()
    ws = [torch.randn(n, k, generator=g).half() for n in NS]
    flags = torch.zeros(2, dtype=torch.int32)
    buf = torch.zeros(world * ms, k, dtype=torch.float16)  # chunk-major: chunk c at rows world * start_c
    for epoch, (t, grid) in enumerate(((tab, 3), (rev, 1), (tab, 2), (rev, 1)), start=1):
        full = torch.randn(world * ms, k, generator=g).half()  # new rows every call
        gathered = torch.empty_like(buf)
        for start, rows in zip(lay.chunk_starts, lay.chunk_rows):
            for r in range(world):
                gathered[world * start + r * rows: world * start + (r + 1) * rows] = full[r * ms + start:
                                                                                      r * ms + start + rows]
        buf[:world * 16] = gathered[:world * 16]  # chunk 0 landed
        flags[0] = epoch

        def land(epoch=epoch, gathered=gathered):
            time.sleep(0.5)
            buf[world * 16:] = gathered[world * 16:]
            flags[1] = epoch

        th = threading.Thread(target=land)
        th.start()
        ew = ErrorWord("cpu", what="multi")
        cs = [torch.full((world * ms, n), float("nan")).half() for n in NS]
        launch_tile_gemm(full[:ms].clone(), [w.t() for w in ws], cs, t, a2=buf, flags=flags, err=ew.word,
                         epoch=epoch, grid=grid, config=CFG, wait=True, max_spins=5_000_000)
        th.join()
        ew.check()
        for i, (c, w) in enumerate(zip(cs, ws)):
            assert _rel(c, full.double() @ w.double().t()) < TOL[torch.float16], (epoch, i, "a stale read")
    # chunk 1 never lands this call: its rows are NaN for every weight
    full = torch.cat([torch.randn(ms, k, generator=g).half(), full[ms:]])  # chunk 0's rows as landed
    ew = ErrorWord("cpu", what="multi")
    cs = [torch.full((world * ms, n), float("nan")).half() for n in NS]
    flags[0] = 5
    launch_tile_gemm(full[:ms].clone(), [w.t() for w in ws], cs, rev, a2=buf, flags=flags, err=ew.word, epoch=5,
                     grid=1, config=CFG, wait=True, max_spins=200)
    try:
        ew.check()
    except FlagTimeoutError as e:
        assert (e.flag_idx, e.expected, e.seen) == (1, 5, 4), e
    else:
        raise AssertionError("a chunk that never landed was not reported")
    for c in cs:  # the peer's chunk 1 (C rows ms + 16 ..) of every weight: not written
        assert torch.isnan(c[ms + 16:]).all(), "a tile of chunk 1 stored numbers"
    # the last weight's tiles ran first (the others were skipped after the timeout): the rows
    # that had landed are right
    assert _rel(cs[-1][:ms + 16], full[:ms + 16].double() @ ws[-1].double().t()) < TOL[torch.float16]


@interpreted
def test_launch_refuses_bad_weight_lists() -> None:
    from tests.kernels._interp_common import CFG
    from overlap.kernels.tile_gemm import TileGemmPlan, launch_tile_gemm

    a = torch.randn(32, 32).half()
    tab = torch.tensor(build_multi_tile_table([Segment(0, 0, 0, 32)], [16, 16], 16, 16), dtype=torch.int32)
    cs = [torch.empty(32, 16).half(), torch.empty(32, 16).half()]
    w = torch.randn(16, 32).half()
    cases = {
        "K mismatch": ([w.t(), torch.randn(16, 48).half().t()], cs),
        "at most 4": ([w.t()] * 5, [cs[0]] * 5),
        "share a B layout": ([w.t(), w.t().contiguous()], cs),
        "dtype": ([w.t(), w.float().t()], cs),
        "one C per weight": ([w.t(), w.t()], cs[:1]),
        "unit column stride": ([w.t(), w.t()], [cs[0], torch.empty(16, 32).half().t()]),
    }
    for want, (bs, cc) in cases.items():
        for fn in (lambda: launch_tile_gemm(a, bs, cc, tab, grid=1, config=CFG),
                   lambda: TileGemmPlan(a, bs, cc, tab, config=CFG)):
            with pytest.raises(ValueError, match=want):
                fn()
    with pytest.raises(ValueError, match="no k_wait"):
        TileGemmPlan(a, [w.t(), w.t()], cs, tab, config=CFG, flags=torch.zeros(4, dtype=torch.int32),
                     err=torch.zeros(8, dtype=torch.int32), wait=True, post=True)


def _ptx_params(num_b: int) -> list[str]:
    """The sm_90 kernel's parameters (Triton's own ptxas, no GPU needed) at ``num_b`` weights."""
    ptx = sm90_kernel(num_b).asm["ptx"]
    entry = ptx[ptx.index(".entry"):]
    return [ln.strip() for ln in entry[:entry.index(")")].splitlines() if ".param" in ln]


def sm90_kernel(num_b: int = 1, *, pdl_trigger: bool = False, launch_pdl: bool = False) -> Any:
    """``tile_gemm_kernel`` compiled for sm_90 on the CPU (Triton's own ptxas), waiting with
    split tiles, at ``num_b`` weights."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource
    from triton.runtime.jit import mangle_type
    from triton.tools.tensor_descriptor import TensorDescriptor

    from overlap.kernels import tile_gemm as tg

    fn = tg.tile_gemm_kernel
    bd = TensorDescriptor.from_tensor(torch.empty(512, 256, dtype=torch.bfloat16), [256, 64])
    ad = TensorDescriptor.from_tensor(torch.empty(256, 256, dtype=torch.bfloat16), [128, 64])
    c = torch.empty(256, 512, dtype=torch.bfloat16)
    i32 = torch.empty(8, dtype=torch.int32)
    vals = dict(a_desc=ad, a2_desc=ad, b_desc=bd, c_ptr=c, table_ptr=i32, flags_ptr=i32, err_ptr=i32,
                counter_ptr=i32, rowstat_ptr=i32, colvec_ptr=i32, ws_ptr=torch.empty(8))
    for i in (1, 2, 3):
        on = i < num_b
        vals.update({f"b{i}_desc": bd if on else None, f"c{i}_ptr": c if on else None, f"N{i}": 512 if on else None,
                     f"stride_c{i}m": 512 if on else None})
    meta = tg._meta(tg.DEFAULT_CONFIG, torch.empty(1, dtype=torch.bfloat16), 1, False, True, False, None, False,
                    1, None, 0, split=(0, 2), num_b=num_b, pdl_trigger=pdl_trigger, pdl_join=launch_pdl)
    sig, consts = {}, {}
    for nm in fn.arg_names:
        v = meta[nm] if nm in meta else vals.get(nm, 7)
        if nm in meta or v is None:
            sig[nm], consts[nm] = "constexpr", v
        else:
            sig[nm] = mangle_type(v)
    opts: dict[str, Any] = dict(num_warps=8, num_stages=3)
    if launch_pdl:
        opts["launch_pdl"] = True
    return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=opts)


def test_sm90_build_one_weight_has_no_extra_operands() -> None:
    """Compiled for sm_90 on the CPU (Triton's ptxas): three weights take two more TMA
    descriptors (grid-constant [128]-byte params) and more params; one weight exactly A's,
    A2's and B's, as before the weight list (whose None arguments are constexprs)."""
    pytest.importorskip("triton")
    try:
        one, three = _ptx_params(1), _ptx_params(3)
    except Exception as e:  # noqa: BLE001 - a Triton without the CUDA backend's tools here
        pytest.skip(f"no sm_90 build here: {type(e).__name__}: {e}")
    descs = lambda ps: sum("[128]" in p for p in ps)  # noqa: E731
    assert descs(one) == 3 and descs(three) == 5, (one, three)
    assert len(three) > len(one) + 2, (len(one), len(three))


def test_sm90_build_pdl_trigger_and_dependent_launch() -> None:
    """Programmatic dependent launch, compiled for sm_90 on the CPU: with ``PDL_TRIGGER``
    every program runs ``griddepcontrol.launch_dependents`` (the chain's producer lets its
    consumer start); a dependent (Triton's ``launch_pdl`` option, a compiled kernel of its
    own) ends with ``griddepcontrol.wait`` (``PDL_JOIN``); a plain kernel has neither."""
    pytest.importorskip("triton")
    try:
        plain = sm90_kernel()
    except Exception as e:  # noqa: BLE001 - a Triton without the CUDA backend's tools here
        pytest.skip(f"no sm_90 build here: {type(e).__name__}: {e}")
    trig, dep = sm90_kernel(pdl_trigger=True), sm90_kernel(launch_pdl=True)
    assert "griddepcontrol.launch_dependents" in trig.asm["ptx"] and "griddepcontrol.wait" not in trig.asm["ptx"]
    assert "griddepcontrol.wait" in dep.asm["ptx"] and "griddepcontrol.launch" not in dep.asm["ptx"]
    assert "griddepcontrol" not in plain.asm["ptx"]
    assert dep.metadata.launch_pdl and not plain.metadata.launch_pdl and not trig.metadata.launch_pdl
