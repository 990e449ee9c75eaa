"""One rank of the gloo test of a refusal at a signature the peers agreed before
(test_refusal.py; ``overlap.ops._refusal``), with the job's real store and the group
taken to have a tile-flag path (so every exchange posts to the store). The refusing
rank's bound (OVERLAP_WAIT_TIMEOUT_MS) is set per case: long where the peers must be
found in time on a loaded machine, short where the case waits it out.

    exchange   the refusals of _steps_worker.py (a bad input on the last rank only, every
               op, the reference path: the peers are in each call's exchange; at 2 ranks)
               and a toy op's refusals at new signatures (every size): each one goes
               through the store's decision to the exchange, and every rank raises as
               before; the next calls are right
    band       a toy op at an agreed signature: the peers make no exchange and "move
               data" (a store key stands in for their pushes landing, another for the
               record the refusing rank writes into their flags); the refusing rank
               refuses in band, its peers' error word (on the CPU) raises PeerRefusedError
               naming it and its message, the group is ended on every rank, and after
               overlap.reset the calls are right
    late       the same with the peers not in the call within the bound: the refusing rank
               raises after the bound, and the peers' next exchange raises
               RanksRefusedError naming it; after overlap.reset the calls are right

Inputs change on every call. Prints ``PASS refusal rank=<r>``.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import overlap  # noqa: E402
from overlap import dist  # noqa: E402
from overlap import flags as F  # noqa: E402
from overlap import protocol as P  # noqa: E402
from overlap.ops import _refusal  # noqa: E402
from overlap.ops._agree import RanksOutOfStepError, RanksRefusedError, group_call  # noqa: E402
from tests import _steps_worker as sw  # noqa: E402

RANK, WS = sw.RANK, sw.WS
BAD = WS - 1
K = sw.K
verdicts: list[str] = []


def forced_capable() -> None:
    """Every group counts as having a tile-flag path; record the refusing rank's decisions."""
    _refusal._capable = lambda st: True  # type: ignore[assignment]
    decide = _refusal.decide

    def recorded(*a: Any, **kw: Any) -> str:
        v = decide(*a, **kw)
        verdicts.append(v)
        return v
    _refusal.decide = recorded  # type: ignore[assignment]


def exchange(toy: "Toy") -> None:
    n0 = len(verdicts)
    t0 = time.monotonic()
    cases = 0
    if WS == 2:
        sw.refusals()
        cases += 16
    for m in (3, 5, 7):  # new signatures: the peers exchange
        x = sw.rnd(m, K)
        if RANK == BAD:
            sw.expect(lambda: toy(x[0]), "toy, new signature", (ValueError,), "toy: x must be 2-D")
        else:
            sw.expect(lambda: toy(x), "toy, new signature", (RanksRefusedError,), f"group rank {BAD}")
        cases += 1
    got = verdicts[n0:]
    if RANK == BAD:
        assert len(got) == cases and set(got) == {"exchange"}, got
    else:
        assert not got, got
    right(toy, "after the refusals at new signatures")
    print(f"rank {RANK}: {len(got)} refusals through the store's decision to the exchange "
          f"({time.monotonic() - t0:.1f} s)", flush=True)


class Toy:
    """A group op on the fast path's rule (an agreed key makes no exchange), on a CPU
    runtime of its own group; its "data movement" stands in through the store."""

    def __init__(self) -> None:
        from overlap.ops._runtime import Runtime, check_agree
        from tests.ops._cpu_runtime import cuda_stand_ins

        self.grp = tdist.new_group(list(range(WS)))
        with cuda_stand_ins():
            self.rt = Runtime(self.grp, tuple(range(WS)), RANK, torch.device("cpu"))
        self.store = _refusal._store()
        self.case = 0

        @group_call("toy", opens_p2p=False)
        def toy(x: torch.Tensor, *, group: Any = None) -> torch.Tensor:
            if x.dim() != 2:
                raise ValueError("toy: x must be 2-D, got a 1-D tensor")
            check_agree(self.rt, "toy", ("M", "K"), tuple(x.shape))
            return x * 2

        self.op = toy
        store, me = self.store, self

        def probe(rt: Any, op: str) -> Any:  # the refusing rank: a peer's push of this call landed
            return lambda: any(store.check([f"sim/{me.case}/pushed/{p}"]) for p in range(WS) if p != BAD)

        def write(rt: Any, word: int, bound_s: float) -> list[str]:  # into the peers' flags
            store.set(f"sim/{me.case}/record", str(word))
            return ["toy"]

        _refusal._moving_probe = probe  # type: ignore[assignment]
        _refusal._write_in_band = write  # type: ignore[assignment]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, group=self.grp)

    def pushes(self) -> None:
        """A peer's call on the fast path: its pushes land, then its wait ends at the
        refusing rank's record (the kernel stands in: the record into an error word)."""
        self.store.set(f"sim/{self.case}/pushed/{RANK}", "1")
        self.store.wait([f"sim/{self.case}/record"])
        word = int(self.store.get(f"sim/{self.case}/record"))
        err = F.ErrorWord("cpu", what=f"toy (rank {RANK})")
        err.ranks = tuple(range(WS))
        err.word[:6] = torch.tensor([P.ERR_DISAGREE, RANK, 510, 12345, word, 0], dtype=torch.int32)
        err.check()


def right(toy: Toy, tag: str) -> None:
    """Right calls: at the agreed signature (no exchange) and at a new one (an exchange,
    which reads the store's refusals: one left from before the reset must not count)."""
    for m in (4, 4, 10 + toy.case):
        x = sw.rnd(m, K)
        torch.testing.assert_close(toy(x), x * 2, msg=lambda m: f"{tag}: {m}")
    sw.good(tag)


def band(toy: Toy) -> None:
    toy.case += 1
    toy(sw.rnd(4, K))  # agreed: an exchange on every rank
    x = sw.rnd(4, K)
    t0 = time.monotonic()
    if RANK == BAD:
        n0 = len(verdicts)
        try:
            toy(x[0])
        except ValueError as e:
            msg = str(e)
            notes = " ".join(getattr(e, "__notes__", []))
        else:
            raise AssertionError("in band: no error")
        assert "toy: x must be 2-D" in msg, msg
        for s in ("peers were already in this call's data movement", "peer memory (toy)", "overlap.reset"):
            assert s in notes, (s, notes)
        assert verdicts[n0:] == ["band"], verdicts[n0:]
    else:
        assert torch.equal(toy(x), x * 2)  # no exchange: the fast path's rule
        msg = sw.expect(toy.pushes, "the peer's kernel", (F.PeerRefusedError,), f"group rank {BAD} refused",
                        "toy: x must be 2-D", "overlap.reset(group)")
    took = time.monotonic() - t0
    assert took < 0.5 * F.default_timeout_ms() / 1000, f"the refusal took {took:.1f} s with the peers moving data"
    # the group is ended on every rank: no collective until the reset
    sw.expect(lambda: toy(sw.rnd(4, K)), "after the refusal", (RanksOutOfStepError,), "toy", "out of step")
    overlap.reset(toy.grp)
    right(toy, "after the in-band refusal and reset")
    print(f"rank {RANK}: in band in {took:.2f} s: {msg[:160]}", flush=True)


def late(toy: Toy) -> None:
    toy.case += 1
    toy(sw.rnd(4, K))
    x, x5, x4 = sw.rnd(4, K), sw.rnd(5, K), sw.rnd(4, K)  # the same draws on every rank
    bound = F.default_timeout_ms() / 1000
    if RANK == BAD:
        t0 = time.monotonic()
        try:
            toy(x[0])
        except ValueError as e:
            notes = " ".join(getattr(e, "__notes__", []))
            assert "no peer reached this call within the wait bound" in notes, notes
        else:
            raise AssertionError("no error")
        took = time.monotonic() - t0
        assert bound <= took < bound + 3, f"decided after {took:.1f} s (bound {bound} s)"
        sw.expect(lambda: toy(x4), "after", (RanksOutOfStepError,), "out of step")
    else:
        time.sleep(bound + 1.5)  # a peer later than the bound
        # its next call at a new signature: its exchange reads the refusal first
        sw.expect(lambda: toy(x5), "the peers' next exchange", (RanksRefusedError,),
                  f"group rank {BAD} refused call", "toy: x must be 2-D", "overlap.reset(group)")
        sw.expect(lambda: toy(x4), "after", (RanksOutOfStepError,), "out of step")
    overlap.reset(toy.grp)
    right(toy, "after the late refusal and reset")


def main() -> None:
    dist.init(timeout_s=30)
    warnings.filterwarnings("ignore", message=".*no tile-flag path.*")
    forced_capable()
    sw.good("start")
    only = sys.argv[1:]
    os.environ["OVERLAP_WAIT_TIMEOUT_MS"] = "20000"
    toy = Toy()
    if not only or "exchange" in only:
        exchange(toy)
    if not only or "band" in only:
        band(toy)
    os.environ["OVERLAP_WAIT_TIMEOUT_MS"] = "1000"
    if not only or "late" in only:
        late(toy)
    os.environ["OVERLAP_WAIT_TIMEOUT_MS"] = "20000"
    sw.good("the end")
    print(f"PASS refusal rank={RANK}", flush=True)
    dist.shutdown()


if __name__ == "__main__":
    main()
