"""One rank of a multi-process test of overlap.dist (started by test_dist_multiproc.py).

Usage: python tests/_dist_worker.py SCENARIO [ARGS]   (RANK, WORLD_SIZE, ... in the env)

Prints "PASS <scenario> rank=<r>" on success; an AssertionError exits non-zero. A
DistInitError that a scenario does not expect is printed as "DISTINITERROR <message>"
and exits with 3, so tests can check the message.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as tdist
from _fake_nccl import FakeNccl, FakeNcclConfig

from overlap import dist
from overlap.dist import DistInitError

T = 45.0  # start-up bound for the scenarios that should succeed (4 ranks importing torch on 2 busy cores
#           took over 20 s once)
# torch 2.13 renamed all_gather_into_tensor (still there, deprecated); >=2.4 is supported
_all_gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor


def _input(rank: int, call: int, n: int = 6) -> torch.Tensor:
    """Differs per rank and per call; small integers in float64 so sums are exact."""
    g = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randint(0, 1000, (n,), generator=g).double() + 1e4 * rank + 1e6 * call


def _gloo_threads() -> list[str]:
    """Names of this process's gloo threads (socket loops, worker threads); Linux only."""
    if not os.path.isdir("/proc/self/task"):
        return []
    names = []
    for f in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{f}/comm") as fh:
                names.append(fh.read().strip())
        except OSError:
            pass  # a thread that just ended
    return [n for n in names if "gloo" in n]


def scenario_groups() -> None:
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A tp size that does not divide the world fails before any group exists.
    try:
        dist.init(tp_size=3, timeout_s=T)
        raise AssertionError("tp_size=3 should not divide the world")
    except DistInitError as exc:
        assert "does not divide" in str(exc), exc
    assert not tdist.is_initialized() and dist.get_context() is None

    for tp in [t for t in (1, 2, 4) if ws % t == 0]:
        ctx = dist.init(tp_size=tp, timeout_s=T)
        assert (ctx.launch.launcher, ctx.backend, ctx.device.type) == ("torchrun", "gloo", "cpu")
        assert (ctx.rank, ctx.world_size, ctx.is_main) == (rank, ws, rank == 0)
        tp_ranks = list(range(rank // tp * tp, rank // tp * tp + tp))  # contiguous
        dp_ranks = list(range(rank % tp, ws, tp))                      # strided
        assert dist.group_ranks(ctx.tp_group) == tp_ranks, dist.group_ranks(ctx.tp_group)
        assert dist.group_ranks(ctx.dp_group) == dp_ranks, dist.group_ranks(ctx.dp_group)
        assert dist.group_ranks(ctx.world_group) == list(range(ws))
        assert (ctx.tp_size, ctx.tp_rank) == (tp, tdist.get_rank(ctx.tp_group)) == (tp, rank % tp)
        assert ctx.dp_rank == tdist.get_rank(ctx.dp_group) == rank // tp
        assert ctx.dp_size == ws // tp
        # idempotent; None matches; a different value raises
        assert dist.init(tp_size=tp, timeout_s=T) is ctx and dist.init(timeout_s=T) is ctx
        try:
            dist.init(tp_size=ws if tp != ws else 1, timeout_s=T)
            raise AssertionError("conflicting init should raise")
        except DistInitError as exc:
            assert "already called" in str(exc), exc

        for call in range(3):  # inputs change every call: a stale buffer cannot pass
            x = _input(rank, call)
            got = torch.empty(tp * x.numel(), dtype=x.dtype)
            _all_gather(got, x, group=ctx.tp_group)
            assert torch.equal(got, torch.cat([_input(r, call) for r in tp_ranks])), (call, got)
            y = x.clone()
            tdist.all_reduce(y, group=ctx.tp_group)
            assert torch.equal(y, sum(_input(r, call) for r in tp_ranks)), (call, y)
            z = x.clone()
            tdist.all_reduce(z, group=ctx.dp_group)
            assert torch.equal(z, sum(_input(r, call) for r in dp_ranks)), (call, z)
        ctx.barrier()
        assert _gloo_threads() or not os.path.isdir("/proc/self/task")
        dist.shutdown()
        assert not tdist.is_initialized() and dist.get_context() is None
        # the context is still held here; its groups (and gloo's threads) are gone all the
        # same: left to the interpreter's exit, their teardown aborted a rank now and then
        assert ctx.world_group is None and ctx.tp_group is None and ctx._store is None
        assert not _gloo_threads(), f"threads alive after shutdown: {_gloo_threads()}"
    print(f"PASS groups rank={rank}", flush=True)


def scenario_nccl(tp: int) -> None:
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fake = FakeNccl()
    dist.set_nccl_backend(fake)
    ctx = dist.init(tp_size=tp, timeout_s=T)
    tp_ranks = dist.group_ranks(ctx.tp_group)
    dp_ranks = dist.group_ranks(ctx.dp_group)

    made = {}
    made["tp"] = (tp_ranks, dist.nccl_comm())
    assert dist._last_uid_exchange == ("store" if tp > 1 else "local"), dist._last_uid_exchange
    assert dist.nccl_comm() is made["tp"][1] and dist.nccl_comm(ctx.tp_group) is made["tp"][1]
    made["tp8"] = (tp_ranks, dist.nccl_comm(config=FakeNcclConfig(max_ctas=8)))
    made["world"] = (list(range(ws)), dist.nccl_comm(ctx.world_group))
    made["dp"] = (dp_ranks, dist.nccl_comm(dp_ranks))  # a plain list of ranks works too
    # cached per (ranks, config): with tp == world (or tp == 1) two of these coincide
    keys = {(tuple(ranks), c.config): c for ranks, c in made.values()}
    for ranks, c in made.values():
        assert keys[(tuple(ranks), c.config)] is c
    assert fake.version_checks == len(keys) == len(fake.comms), (fake.version_checks, len(keys))
    n_made = len(fake.ids_made)

    mine = {name: (c.unique_id.hex(), c.nranks, c.rank, repr(c.config)) for name, (_, c) in made.items()}
    everyone: list = [None] * ws
    tdist.all_gather_object(everyone, (mine, [u.hex() for u in fake.ids_made]))

    for name, (ranks, comm) in made.items():
        assert (comm.nranks, comm.rank) == (len(ranks), ranks.index(rank)), (name, comm)
        uids = {everyone[r][0][name][0] for r in ranks}
        assert len(uids) == 1, f"{name}: members got different ids"
        # the id came from the group's rank 0 and from nobody else
        assert comm.unique_id.hex() in everyone[ranks[0]][1], name
        for r in ranks[1:]:
            assert comm.unique_id.hex() not in everyone[r][1], (name, r)
    assert made["tp8"][1].config == FakeNcclConfig(max_ctas=8) and made["tp"][1].config is None
    assert len({c.unique_id for c in keys.values()}) == len(keys), "ids must differ per comm"
    # ids made only where this rank is a group's rank 0 (and a one-rank group makes its own)
    assert n_made == sum(ranks[0] == rank for ranks, _ in keys), n_made

    dist.shutdown()
    assert all(c.destroyed for c in fake.comms)
    print(f"PASS nccl rank={rank} tp={tp}", flush=True)


def scenario_nccl_missing() -> None:
    """Rank 1 never calls nccl_comm: rank 0 must get a bounded, named error."""
    rank = int(os.environ["RANK"])
    dist.set_nccl_backend(FakeNccl())
    dist.init(timeout_s=3.0)
    if rank == 0:
        t0 = time.monotonic()
        try:
            dist.nccl_comm()
            raise AssertionError("nccl_comm should time out")
        except DistInitError as exc:
            msg = str(exc)
            waited = time.monotonic() - t0
            assert "rank(s) [1]" in msg and "nccl_comm" in msg, msg
            assert 2.5 < waited < 10, waited
            print(f"nccl_missing error after {waited:.1f} s: {msg}", flush=True)
    dist.shutdown()
    print(f"PASS nccl_missing rank={rank}", flush=True)


def scenario_nccl_config_mismatch() -> None:
    """Rank 1 asks for another config: every rank gets a DistInitError, none enters NCCL."""
    rank = int(os.environ["RANK"])
    fake = FakeNccl()
    dist.set_nccl_backend(fake)
    dist.init(timeout_s=T)
    try:
        dist.nccl_comm(config=FakeNcclConfig(max_ctas=8) if rank == 1 else None)
        raise AssertionError("a config mismatch should raise")
    except DistInitError as exc:
        assert "another config" in str(exc), exc
    assert fake.comms == [], "no communicator may be made"
    dist.shutdown()
    print(f"PASS nccl_config_mismatch rank={rank}", flush=True)


def scenario_init(timeout_s: float) -> None:
    """Plain init; reports a DistInitError instead of a traceback."""
    t0 = time.monotonic()
    try:
        dist.init(timeout_s=timeout_s)
    except DistInitError as exc:
        print(f"after {time.monotonic() - t0:.1f} s", flush=True)
        print(f"DISTINITERROR {exc}", flush=True)
        sys.exit(3)
    dist.shutdown()
    print(f"PASS init rank={os.environ['RANK']}", flush=True)


def scenario_fail0() -> None:
    """Rank 0 fails (an exception) while rank 1 waits for it in a collective; every rank
    shuts down in a ``finally``. With timeout_s=120 the job must still end in seconds:
    rank 0 does not wait for goodbyes a blocked peer cannot say."""
    t0 = time.monotonic()
    ctx = dist.init(timeout_s=120.0)
    try:
        if ctx.rank == 0:
            raise RuntimeError("rank 0 failed on purpose")
        tdist.all_reduce(torch.ones(4))  # waits for rank 0, which never comes
    finally:
        ts = time.monotonic()
        try:
            dist.shutdown()
        finally:
            # rank 1's failed all-reduce left a traceback holding the group: gone all the same
            print(f"rank {ctx.rank}: shutdown {time.monotonic() - ts:.1f} s, exit after "
                  f"{time.monotonic() - t0:.1f} s, gloo threads left: {_gloo_threads()}", flush=True)


def scenario_goodbye_bound() -> None:
    """Rank 1 never says goodbye; rank 0's clean shutdown waits at most the bound
    (``SHUTDOWN_BOUND_S``, shortened here to 3 s), not the 120 s ``timeout_s``."""
    from overlap.dist import context

    context.SHUTDOWN_BOUND_S = 3.0
    ctx = dist.init(timeout_s=120.0)
    if ctx.rank == 1:
        time.sleep(4)  # busy elsewhere, then gone without shutdown
        sys.stdout.flush()
        os._exit(0)
    import warnings

    ts = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.shutdown()
    took = time.monotonic() - ts
    assert 2.5 <= took < 6.0, f"shutdown took {took:.1f} s with a bound of 3 s"
    assert any("not every rank reached shutdown" in str(w.message) for w in caught), caught
    print(f"PASS goodbye_bound rank=0 ({took:.1f} s)", flush=True)


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    if name == "groups":
        scenario_groups()
    elif name == "nccl":
        scenario_nccl(int(args[0]))
    elif name == "nccl_missing":
        scenario_nccl_missing()
    elif name == "nccl_config_mismatch":
        scenario_nccl_config_mismatch()
    elif name == "init":
        scenario_init(float(args[0]))
    elif name == "fail0":
        scenario_fail0()
    elif name == "goodbye_bound":
        scenario_goodbye_bound()
    else:
        raise SystemExit(f"unknown scenario {name!r}")
    # The scenario passed and said so. Leave without the interpreter's teardown: about one
    # run in a few, a rank aborted there after dist.shutdown() ("terminate called without
    # an active exception", a C++ thread of torch's gloo / store layer still joinable at
    # exit), which is not what these tests check.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
