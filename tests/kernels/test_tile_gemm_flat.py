"""GemmConfig.flatten: the tile GEMM whose tile loop and K loop are one software pipeline
(``tile_gemm_flat_kernel``), under the Triton interpreter: outputs against torch, waits
and posts per group of rows, and what it refuses.

Each test runs in a child process with TRITON_INTERPRET=1 (``tests._interp``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tests._interp import interpreted



def _flat():
    from tests.kernels._interp_common import CFG

    return replace(CFG, flatten=True)


@interpreted
def test_flat_outputs_any_grid_and_layout() -> None:
    """Any grid size, partial tiles, both B layouts, fp16 and fp32, GeLU: the same C as torch;
    a new input every call (a stale read fails)."""
    from tests.kernels._interp_common import TOL, Segment, _rel, _table, launch_tile_gemm

    g = torch.Generator().manual_seed(0)
    cfg = _flat()
    for dt in (torch.float16, torch.float32):
        for m, n, k in ((40, 48, 32), (33, 24, 48)):
            w = torch.randn(n, k, generator=g).to(dt)
            table = _table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, cfg)
            for b in (w.t(), w.t().contiguous()):
                for grid, act in ((1, None), (3, "gelu"), (64, None)):
                    a = torch.randn(m, k, generator=g).to(dt)
                    c = torch.full((m, n), float("nan"), dtype=dt)
                    launch_tile_gemm(a, b, c, table, grid=grid, config=cfg, activation=act)
                    ref = a.double() @ w.double().t()
                    ref = torch.nn.functional.gelu(ref) if act else ref
                    assert not torch.isnan(c).any(), "an output element was not written"
                    assert _rel(c, ref) < TOL[dt], (dt, m, n, k, grid, _rel(c, ref))


@interpreted
def test_flat_posts_count_each_group() -> None:
    """Posts by group (runs of rows with one post index): each flag ends at its group's
    tile count, whatever the grid; rows without a post index add nothing; a plan
    (TileGemmPlan) posts the same."""
    from overlap.kernels.tile_gemm import TileGemmPlan
    from overlap.policies import flat_groups
    from tests.kernels._interp_common import TOL, Segment, _rel, _table, launch_tile_gemm

    g = torch.Generator().manual_seed(1)
    cfg = _flat()
    m, n, k = 64, 48, 32  # 4 row blocks x 3 column tiles
    rows = _table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, cfg).numpy().copy()
    from overlap import protocol as P

    # chunks of rows as the producer ops post them: tiles 0-4 -> flag 2, 5-8 -> flag 0, 9-11 none
    rows[:, P.COL_POST] = [2] * 5 + [0] * 4 + [-1] * 3
    table = torch.tensor(rows)
    groups = torch.tensor(flat_groups(rows))
    assert groups.tolist() == [[0, 5, -1, 1, 2, 0], [5, 9, -1, 1, 0, 0], [9, 12, -1, 1, -1, 0]]
    w = torch.randn(n, k, generator=g, dtype=torch.float16)
    for grid in (1, 2, 5, 12):
        a = torch.randn(m, k, generator=g, dtype=torch.float16)
        flags = torch.full((4,), 7, dtype=torch.int32)
        err = torch.zeros(8, dtype=torch.int32)
        c = torch.full((m, n), float("nan"), dtype=torch.float16)
        launch_tile_gemm(a, w.t(), c, table, flags=flags, err=err, grid=grid, config=cfg, post=True, groups=groups)
        assert flags.tolist() == [7 + 4, 7, 7 + 5, 7], (grid, flags)
        assert _rel(c, a.double() @ w.double().t()) < TOL[torch.float16]
    plan = TileGemmPlan(a, w.t(), c, table, flags=flags, err=err, config=cfg, post=True, groups=groups)
    a2 = torch.randn(m, k, generator=g, dtype=torch.float16)
    plan.launch(plan.operands(a2, w.t()), c, epoch=1, grid=3)
    assert flags.tolist() == [7 + 8, 7, 7 + 10, 7], flags
    assert _rel(c, a2.double() @ w.double().t()) < TOL[torch.float16]


@interpreted
def test_flat_waits_per_group() -> None:
    """Waits per group: a program waits for a group's flag before any of its rows of the
    group; with one flag not posted, that group's tiles are NaN (a stale read would
    fill them) and the error names the flag; once posted, a new call with new inputs is
    right everywhere. Two A sources by group (the all-gather op's local shard and buffer)."""
    from overlap.flags import FlagTimeoutError
    from overlap.policies import flat_groups
    from tests.kernels._interp_common import TOL, ErrorWord, Segment, _rel, _table, launch_tile_gemm

    g = torch.Generator().manual_seed(2)
    cfg = _flat()
    m, n, k = 64, 32, 32
    # rows 0-31 from A (no wait), rows 32-47 from A2 behind flag 0, rows 48-63 from A2 behind flag 1
    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=32),
            Segment(a_src=1, a_row=0, c_row=32, rows=16, wait_idx=0, wait_mult=1),
            Segment(a_src=1, a_row=16, c_row=48, rows=16, wait_idx=1, wait_mult=1)]
    rows = _table(segs, n, cfg).numpy()
    groups = torch.tensor(flat_groups(rows))
    assert [r[2:] for r in groups.tolist()] == [[-1, 1, -1, 0], [0, 1, -1, 1], [1, 1, -1, 1]]
    w = torch.randn(n, k, generator=g, dtype=torch.float16)
    for grid in (1, 3):
        a, a2 = torch.randn(32, k, generator=g, dtype=torch.float16), torch.randn(32, k, generator=g,
                                                                                    dtype=torch.float16)
        flags = torch.tensor([5, 4], dtype=torch.int32)  # epoch 5: flag 0 posted, flag 1 not yet
        ew = ErrorWord("cpu", what="flat")
        c = torch.full((m, n), float("nan"), dtype=torch.float16)
        launch_tile_gemm(a, w.t(), c, torch.tensor(rows), a2=a2, flags=flags, err=ew.word, epoch=5, grid=grid,
                         config=cfg, wait=True, groups=groups, max_spins=50)
        want = torch.cat([a, a2]).double() @ w.double().t()
        if grid == 1:  # one program: the groups before the late one are done before it waits
            assert _rel(c[:48], want[:48]) < TOL[torch.float16]
        # (with more programs, those the interpreter runs after the timeout skip their work:
        # a timed-out call stops every program, as the per-tile kernel does)
        assert torch.isnan(c[48:]).all(), "a tile read its A rows before their flag"
        with pytest.raises(FlagTimeoutError, match="flag 1"):
            ew.check()
        flags[1] = 5
        ew = ErrorWord("cpu", what="flat")
        a2.copy_(torch.randn(32, k, generator=g, dtype=torch.float16))
        launch_tile_gemm(a, w.t(), c, torch.tensor(rows), a2=a2, flags=flags, err=ew.word, epoch=5, grid=grid,
                         config=cfg, wait=True, groups=groups, max_spins=50)
        ew.check()
        want = torch.cat([a, a2]).double() @ w.double().t()
        assert _rel(c, want) < TOL[torch.float16], grid


@interpreted
def test_flat_refusals() -> None:
    """What a flattened GEMM does not take is refused by name: TileSync, split tiles,
    several weights; waits, posts or a second A without groups."""
    from tests.kernels._interp_common import Segment, _table, launch_tile_gemm, split_workspace

    cfg = _flat()
    m, n, k = 32, 32, 32
    a, w = torch.randn(m, k, dtype=torch.float16), torch.randn(n, k, dtype=torch.float16)
    c = torch.empty(m, n, dtype=torch.float16)
    table = _table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, cfg)
    fl, err = torch.zeros(4, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    cnt = torch.zeros(8, dtype=torch.int32)
    cases = {"k_wait": dict(wait=True, k_wait=1, flags=fl, err=err),
             "split": dict(split=(2, 2), counter=cnt, workspace=split_workspace((2, 2), 4, cfg, "cpu")),
             "several weights": dict(b=[w.t(), w.t()], c=[c, c.clone()]),
             "groups": dict(post=True, flags=fl, err=err)}
    for word, kw in cases.items():
        args = dict(b=w.t(), c=c)
        args.update(kw)
        b_, c_ = args.pop("b"), args.pop("c")
        try:
            launch_tile_gemm(a, b_, c_, table, grid=2, config=cfg, **args)
        except ValueError as e:
            assert word in str(e), (word, e)
        else:
            raise AssertionError(f"flatten accepted {word}")
    for extra in (dict(wait=True, flags=fl, err=err), dict(a2=a)):
        try:
            launch_tile_gemm(a, w.t(), c, table, grid=2, config=cfg, **extra)
        except ValueError as e:
            assert "groups" in str(e), e
        else:
            raise AssertionError(f"flatten without groups accepted {list(extra)}")


def test_flatten_and_warp_specialize_do_not_combine() -> None:
    from overlap.kernels.tile_gemm import GemmConfig

    with pytest.raises(ValueError, match="flatten"):
        GemmConfig(flatten=True, warp_specialize=True)
    assert GemmConfig(flatten=True).flatten and not GemmConfig().flatten


def test_flat_groups_runs_and_refusal() -> None:
    """Runs of rows with one wait flag, wait multiple, post flag and A source; a post flag
    whose rows fall in two runs is refused (a per-run count could not tell it complete)."""
    from overlap import protocol as P
    from overlap.policies import flat_groups

    rows = np.zeros((7, P.TABLE_COLS), dtype=np.int32)
    rows[:, P.COL_WAIT] = [-1, -1, -1, -1, 2, 2, 2]
    rows[:, P.COL_WAIT_MULT] = [1, 1, 1, 1, 1, 1, 3]
    rows[:, P.COL_POST] = [-1, 3, 3, 1, -1, -1, -1]
    rows[:, P.COL_A_SRC] = [0, 0, 0, 0, 0, 1, 1]
    assert flat_groups(rows).tolist() == [[0, 1, -1, 1, -1, 0], [1, 3, -1, 1, 3, 0], [3, 4, -1, 1, 1, 0],
                                          [4, 5, 2, 1, -1, 0], [5, 6, 2, 1, -1, 1], [6, 7, 2, 3, -1, 1]]
    assert flat_groups(np.zeros((0, P.TABLE_COLS), dtype=np.int32)).shape == (0, 6)
    rows[:, P.COL_POST] = [0, 0, 1, 1, 0, 0, 0]  # flag 0 in two runs
    with pytest.raises(ValueError, match="more than one run"):
        flat_groups(rows)
