"""M that changes every call (an inference server, variable-length training) on the CPU:
every per-shape cache the ops keep is bounded, the ranks' agreement check runs once per
row bucket (not once per M), and the tile tables are built fast enough for the hot path."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as tdist

from overlap.ops import OverlapConfig
from overlap.ops import _runtime as rtm
from overlap.ops import all_gather as ag
from overlap.ops import all_reduce as ar
from overlap.ops import chain as ch
from overlap.ops import matmul_reduce as mr
from overlap.policies import all_gather_layout, build_tile_table, row_bucket
from tests._procs import free_port
from tests.ops._cpu_runtime import cpu_runtime


@pytest.fixture
def group() -> Any:
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield tdist.group.WORLD
    tdist.destroy_process_group()


def test_lru_keeps_the_most_recent() -> None:
    c = rtm.LRU(3)
    for i in range(5):
        c[i] = i
    assert list(c) == [2, 3, 4]
    assert c.get(2) == 2 and c.get(0) is None  # a read makes 2 the most recent
    c[5] = 5
    assert list(c) == [4, 2, 5]
    c.add("sig")
    assert "sig" in c and len(c) == 3
    with pytest.raises(ValueError):
        rtm.LRU(0)


def test_agreement_checked_once_per_bucket(group: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """1000 calls with M random in [1, 16384]: the blocking all-gather runs once per row
    bucket (8 of them), and what it compares is every value, M included."""
    gathers: list[list[int]] = []
    real = rtm.gather_ints

    def counting(grp: Any, world: int, values: list[int], device: Any) -> Any:
        gathers.append(list(values))
        return real(grp, world, values, device)

    monkeypatch.setattr(rtm, "gather_ints", counting)
    rt = cpu_runtime(group)
    rng = random.Random(0)
    ms = [rng.randint(1, 16384) for _ in range(1000)]
    for m in ms:
        rtm.check_agree(rt, "op", ("M", "K"), (m, 64), rows_at=0)
    buckets = {row_bucket(m) for m in ms}
    assert len(gathers) == len(buckets) <= 8, (len(gathers), sorted(buckets))
    h = rtm._agree._HEAD  # the exchange's header (call counter, verdict, ...) comes first
    assert all(row_bucket(v[h]) in buckets and v[h + 1] == 64 for v in gathers)
    # without rows_at (a value that must match exactly), each new value is checked
    for m in (5, 6, 5):
        rtm.check_agree(rt, "op2", ("M", "K"), (m, 64))
    assert len(gathers) == len(buckets) + 2


def test_plans_and_tables_bounded() -> None:
    """200 random M through the all-gather's, all-reduce's and GEMM -> reduce ops' plans and
    the chain's tables: each cache holds at most its cap, and a plan made again after
    eviction is the same."""
    rt = cpu_runtime()  # the chain's runtime is another (local) one; its caches are the same kind
    cfg = OverlapConfig(chunks=2)
    rng = random.Random(1)
    first = ag._plan(rt, 300, 256, 128, cfg)
    for _ in range(200):
        m = rng.randint(1, 4096)
        ag._plan(rt, m, 256, 128, cfg)
        ar._plan(rt, m, 256, 128, cfg)
        mr._plan(rt, "matmul_all_reduce", m, 256, 128, cfg)
        ch._tables(rt, m, 512, 256, ch.ChainConfig())
    for plans in (ag._plans(rt), ar._plans(rt), mr._plans(rt), ch._tables_of(rt)):
        assert len(plans) == plans.cap == 64
    again = ag._plan(rt, 300, 256, 128, cfg)
    assert again is not first and torch.equal(again.table, first.table)
    for cache, cap in ((ag._tuned(rt), 256), (ar._tuned(rt), 256), (mr._tuned(rt), 256), (ch._tuned(rt), 256),
                       (ag._perms(rt), 16), (rt.cache("agreed", rtm.AGREED_CAP), 1024)):
        assert isinstance(cache, rtm.LRU) and cache.cap == cap, cache
    for plan in (first, mr._plan(rt, "matmul_all_reduce", 300, 256, 128, cfg)):
        assert isinstance(plan.launches, rtm.LRU) and plan.launches.cap == 16


def test_seen_signatures_bounded() -> None:
    """The capture check's memory of eager calls keeps the most recent signatures (a
    recent one can still be captured after thousands of other shapes)."""
    holder = SimpleNamespace(seen=rtm.LRU(4096))
    for m in range(10_000):
        rtm.Runtime.require_warm(holder, "op", (m,))
        rtm.Runtime.mark_warm(holder, "op", (m,), None)  # recorded once the call returned
    assert len(holder.seen) == 4096 and ("op", (9_999,)) in holder.seen and ("op", (0,)) not in holder.seen


def test_local_words_grow_by_powers_of_two() -> None:
    """The chain's flags follow M: growing M one row block at a time reallocates the
    words a logarithmic number of times, not once per M."""
    lw = rtm.LocalWords(torch.device("cpu"))
    bufs = set()
    for n_flags in range(1, 3000, 7):
        w = lw.get("op", 8, n_flags)
        assert w.flags.numel() == n_flags
        bufs.add(w.buf.untyped_storage().data_ptr())
    assert len(bufs) <= 8, len(bufs)


def test_local_words_views_reused_only_at_their_size() -> None:
    """A call of the size of the last one gets the same views back (no slicing per call);
    any other size gets views of its own size, over the same buffer while it fits."""
    lw = rtm.LocalWords(torch.device("cpu"))
    for nc, nf in ((1, 2), (1, 2), (5, 2), (5, 3), (1, 2), (5, 3), (4, 40), (4, 40), (1, 1)):
        w = lw.get("op", nc, nf)
        ncr = -(-nc // 4) * 4
        assert (w.counters.numel(), w.flags.numel(), w.buf.numel()) == (ncr, nf, ncr + nf)
        assert w.flags.data_ptr() == w.buf.data_ptr() + 4 * ncr and w.counters.data_ptr() == w.buf.data_ptr()
        assert lw.get("op", nc, nf) is w
    assert lw.get("other", 1, 2) is not lw.get("op", 1, 2)


def test_tile_table_fast() -> None:
    """A new M builds a new tile table on the hot path: 2048 tiles in well under the 6 ms
    a Python loop took (a generous bound for a loaded CI machine)."""
    lay = all_gather_layout(2, 0, 8192, 4, 128)
    build_tile_table(lay.segments, 4096, 128, 256, array=True)
    t0 = time.perf_counter()
    for _ in range(10):
        t = build_tile_table(lay.segments, 4096, 128, 256, array=True)
    assert t.shape == (2048, 8)
    assert (time.perf_counter() - t0) / 10 < 3e-3
