"""Tile-flag GEMM scenarios under the Triton interpreter (run by test_kernels_interp.py).

Usage: TRITON_INTERPRET=1 python tests/_kernel_interp_worker.py SCENARIO
Prints "PASS <scenario>"; a failed check raises.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from overlap.flags import ErrorWord, FlagTimeoutError  # noqa: E402
from overlap.kernels.tile_gemm import GemmConfig, launch_tile_gemm  # noqa: E402
from overlap.policies import RowSync, Segment, all_gather_layout, build_tile_table, row_block_segments  # noqa: E402

CFG = GemmConfig(block_m=16, block_n=16, block_k=16, num_stages=1, num_warps=4)
TOL = {torch.float16: 2e-3, torch.float32: 1e-5}


def _table(segs, n, cfg=CFG, group_m=2):
    return torch.tensor(build_tile_table(segs, n, cfg.block_m, cfg.block_n, group_m), dtype=torch.int32)


def _rel(x, y):
    return ((x.double() - y.double()).norm() / y.double().norm()).item()


def scenario_schedules() -> None:
    """Any tile order, partial tiles, both B layouts, fp16 and fp32, two grid sizes."""
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float16, torch.float32):
        for (m, n, k) in [(40, 48, 32), (33, 24, 48)]:
            a = torch.randn(m, k, generator=g).to(dt)
            w = torch.randn(n, k, generator=g).to(dt)
            ref = a.double() @ w.double().t()
            table = _table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n)
            perm = torch.randperm(table.shape[0], generator=g)
            for b in (w.t(), w.t().contiguous()):
                for tab, grid in ((table, 3), (table[perm].contiguous(), 5)):
                    c = torch.full((m, n), float("nan"), dtype=dt)
                    launch_tile_gemm(a, b, c, tab, grid=grid, config=CFG)
                    assert not torch.isnan(c).any(), "an output element was not written"
                    assert _rel(c, ref) < TOL[dt], (dt, m, n, k, _rel(c, ref))
    # rows that TMA cannot address are refused with a clear error, not an assert
    w = torch.randn(20, 48, dtype=torch.float16)
    try:
        launch_tile_gemm(torch.randn(16, 48, dtype=torch.float16), w.t().contiguous(),
                         torch.empty(16, 20, dtype=torch.float16), _table([Segment(0, 0, 0, 16)], 20), grid=1,
                         config=CFG)
    except ValueError as e:
        assert "16-byte" in str(e), e
    else:
        raise AssertionError("misaligned B accepted")
    print("PASS schedules")


def scenario_all_gather_layout() -> None:
    """Two A sources and the chunk-major gathered buffer map back to natural C rows."""
    g = torch.Generator().manual_seed(1)
    world, ms, k, n = 3, 37, 32, 24
    for rank in range(world):
        for chunks in (1, 2, 3):
            full = torch.randn(world * ms, k, generator=g, dtype=torch.float32)
            w = torch.randn(n, k, generator=g, dtype=torch.float32)
            lay = all_gather_layout(world, rank, ms, chunks, CFG.block_m)
            gathered = torch.empty_like(full)
            for start, rows in zip(lay.chunk_starts, lay.chunk_rows):
                for r in range(world):  # what NCCL's all-gather of chunk c writes
                    gathered[world * start + r * rows: world * start + (r + 1) * rows] = \
                        full[r * ms + start: r * ms + start + rows]
            perm = torch.tensor(lay.gathered_to_natural())
            assert torch.equal(gathered[perm], full)
            a_shard = full[rank * ms:(rank + 1) * ms].clone()
            flags = torch.full((4,), 5, dtype=torch.int32)  # every chunk landed in epoch 5
            err = torch.zeros(8, dtype=torch.int32)
            c = torch.full((world * ms, n), float("nan"))
            launch_tile_gemm(a_shard, w.t(), c, _table(lay.segments, n), a2=gathered, flags=flags, err=err,
                             epoch=5, grid=4, config=CFG, wait=True)
            assert err[0].item() == 0, err
            assert _rel(c, full.double() @ w.double().t()) < 1e-5, (rank, chunks)
    print("PASS all_gather_layout")


def scenario_posts_and_gelu() -> None:
    """RowSync waits satisfied; every producer tile posts once to its row block; GeLU epilogue."""
    g = torch.Generator().manual_seed(2)
    m, n, k = 40, 48, 32
    a = torch.randn(m, k, generator=g, dtype=torch.float16)
    w = torch.randn(n, k, generator=g, dtype=torch.float16)
    n_tiles = 3
    segs = row_block_segments(m, CFG.block_m, wait=RowSync(producer_n_tiles=n_tiles), post=True)
    wait_flags = torch.full((8,), 4 * n_tiles, dtype=torch.int32)  # epoch 4 fully posted upstream
    err = torch.zeros(8, dtype=torch.int32)
    c = torch.empty(m, n, dtype=torch.float16)
    launch_tile_gemm(a, w.t(), c, _table(segs, n), flags=wait_flags, err=err, epoch=4, grid=2, config=CFG,
                     wait=True, post=True, activation="gelu")
    assert err[0].item() == 0
    # 3 row blocks x 3 column tiles: each row block's flag got exactly 3 posts
    assert wait_flags.tolist() == [4 * n_tiles + 3] * 3 + [4 * n_tiles] * 5, wait_flags
    ref = torch.nn.functional.gelu(a.double() @ w.double().t())
    assert _rel(c, ref) < 2e-3
    print("PASS posts_and_gelu")


def scenario_timeout() -> None:
    """A flag never posted (and one left from the previous epoch) ends in a clear error, not a hang."""
    g = torch.Generator().manual_seed(3)
    m, n, k = 32, 32, 16
    a = torch.randn(m, k, generator=g, dtype=torch.float32)
    w = torch.randn(n, k, generator=g, dtype=torch.float32)
    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=16),  # ready
            Segment(a_src=0, a_row=16, c_row=16, rows=16, wait_idx=1)]
    for stale in (0, 6):  # 6 = the previous call's epoch: must not satisfy epoch 7
        flags = torch.tensor([0, stale], dtype=torch.int32)
        ew = ErrorWord("cpu", what="test op")
        c = torch.full((m, n), float("nan"))
        launch_tile_gemm(a, w.t(), c, _table(segs, n), flags=flags, err=ew.word, epoch=7, rank=3, grid=2,
                         config=CFG, wait=True, max_spins=200)
        try:
            ew.check()
        except FlagTimeoutError as e:
            assert (e.rank, e.flag_idx, e.expected, e.seen) == (3, 1, 7, stale), e
            assert "rank 3" in str(e) and "flag 1" in str(e)
        else:
            raise AssertionError("timeout not reported")
        assert torch.isnan(c[16:]).all(), "a tile that timed out must not write"
        assert ew.word.tolist() == [0] * 8, "the word is cleared once reported"
    print("PASS timeout")


def scenario_dispatch_counter() -> None:
    """Two launches share one table through the dispatch counter: every tile runs exactly once."""
    g = torch.Generator().manual_seed(4)
    m, n, k = 64, 64, 16
    a = torch.randn(m, k, generator=g, dtype=torch.float32)
    w = torch.randn(n, k, generator=g, dtype=torch.float32)
    segs = row_block_segments(m, CFG.block_m, post=True)
    flags = torch.zeros(8, dtype=torch.int32)
    err = torch.zeros(8, dtype=torch.int32)
    counter = torch.zeros(1, dtype=torch.int32)
    c = torch.full((m, n), float("nan"))
    tab = _table(segs, n)
    launch_tile_gemm(a, w.t(), c, tab, flags=flags, err=err, grid=2, config=CFG, post=True, counter=counter)
    launch_tile_gemm(a, w.t(), c, tab, flags=flags, err=err, grid=3, config=CFG, post=True, counter=counter)
    assert flags[:4].tolist() == [4, 4, 4, 4], flags  # 4 column tiles per row block, each once
    assert _rel(c, a.double() @ w.double().t()) < 1e-5
    print("PASS dispatch_counter")


if __name__ == "__main__":
    globals()["scenario_" + sys.argv[1]]()
