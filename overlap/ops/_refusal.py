"""A refusal on one rank at a signature its peers agreed before (the tile-flag path).

A call whose signature the ranks agreed before makes no exchange on the tile-flag path:
its peers go straight into the call's data movement. A rank that refuses such a call (a
1-D input, a bad norm, another thread's call in flight) cannot meet them in an exchange:
an exchange posted there would pair with whatever collective its peers make next. So a
refusing rank first learns where its peers are, then takes one of two ways:

    refusing rank                                  peers
    post R = (era, call, "pending", why)           in an exchange (a new signature):
    poll, bounded by the wait bound:                 post P = (era, call), then read R
      every peer posted P at this call -> exchange   (a "pending" R at this call: wait
      a peer's push of this call landed -> in band    for its final state)
      the bound passed -> in band ("late")         in the data movement (agreed):
    R = the way taken                                their pushes land in the refusing
    in band: a refusal record in every peer's        rank's flags; their waits end at its
      flags, the group ended here                    refusal record

- **Exchange** (the peers' signature was new, or they exchange every call): the exchange
  carries the refusal as any verdict (``overlap.ops._agree``); every rank raises, and the
  group goes on.
- **In band**: in each peer's shared flags, for every op that has run on the peer-copy
  transport, this rank writes its sender signature word of the op's next call (the word a
  peer's kernel compares after its wait) with a refusal record
  (``overlap.protocol.refusal_word``: the rank, the call, the error's type), then every
  chunk flag of its region to that call's epoch. A peer's wait for this rank's rows then
  ends at once, its kernel finds the record instead of a signature and stores NaN (as for
  any signature that differs), and its host raises ``overlap.flags.PeerRefusedError``
  (a ``RanksRefusedError``) naming the rank, with the refusing rank's message read from
  the job's store. The group's ops are then ended on every rank (the refusing rank at
  once, each peer when it raises that error, or at its next exchange, which reads R
  first) until ``overlap.reset(group)``.

P and R live in the job's store (``overlap.dist``'s, else torch's default store), keyed by
the group's ranks; they hold the group's call counter and an era that every
``overlap.reset`` (and shutdown) moves on alike on every rank, so a stale key never matches
a later call. Only groups with a tile-flag path (a peer heap or an NCCL communicator) use
them; an exchange there also posts P and reads a counter of refusals (two store round
trips, on new signatures only); the fast path touches nothing here.

The record is written after this rank's previous call of each op ended on its GPU, which
came after the peers' pushes of that call, which they queued after their own previous
call of it: a peer's kernels of an earlier call never read the word or the flags written
(``overlap._p2p``: the same argument as the buffers' halves). A chunk flag at the next
call's epoch is one call ahead of a peer still in its previous call: not "ahead" (two
calls). The signature word is written before the chunk flags, on one stream, so a wait
that sees a flag sees the record.

What this does not cover (docs/guarantees.md): on the NCCL transport no push tells the
refusing rank that its peers are moving data, so it waits out the bound (then in band:
the store keeps its refusal for the peers' next exchange) while the peers' waits time
out; peers that disagree among themselves (some in an exchange, some moving data) leave
the exchanging ones waiting for the process group's timeout.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from .. import flags as _flags
from .. import protocol as P
from . import _agree

__all__ = ["SENDER_REGIONS", "sender_region", "era", "next_era", "Board", "board_of", "decide", "before_exchange",
           "refuse_in_band", "write_in_band"]

SENDER_REGIONS = {"all_gather_matmul": "rank", "all_reduce_matmul": "slot", "matmul_reduce_scatter": "slot",
                  "matmul_all_reduce": "slot"}
"""The shared flag regions the peer-copy ops use, and where a sender's region lies in a
receiver's flags: at the sender's rank (the all-gather), or at its push slot
(``overlap.policies.push_slot``; the all-reduce, one- and two-shot, and the producers).
A region not named here is never written by a refusal (a wrong guess would release a
peer's wait before its rows landed)."""

POLL_S = 0.002

_eras: dict[Any, int] = {}


def era(ranks: tuple[int, ...]) -> int:
    """The group's era: moved on by every ``reset`` of it and every shutdown, alike on every rank."""
    return _eras.get(None, 0) + _eras.get(ranks, 0)


def next_era(ranks: tuple[int, ...] | None) -> None:
    """A reset of the group of ``ranks`` (every group: None) on this rank."""
    _eras[ranks] = _eras.get(ranks, 0) + 1


def sender_region(op: str, sender: int, receiver: int, world: int) -> int:
    """The region (in flag strides) of ``sender``'s chunk flags in ``receiver``'s flags of ``op``."""
    from ..policies import push_slot

    how = SENDER_REGIONS[op]
    return sender if how == "rank" else push_slot(sender, receiver, world)


class Board:
    """The group's keys in the store: P (``x/<rank>``: "era:call" of the rank's latest
    exchange), R (``r/<rank>``: "era:call:state:why" of its latest refusal, state one of
    pending, exchange, band, late) and a count of refusals posted (``n``)."""

    def __init__(self, store: Any, ranks: tuple[int, ...], rank: int, name: str = "") -> None:
        self.store, self.ranks, self.rank = store, ranks, rank
        # by the group's name (alike on every rank): two groups of the same ranks count their calls apart
        self.prefix = f"refusal/{name or '-'.join(str(r) for r in ranks)}"

    def _get(self, key: str) -> str | None:
        k = f"{self.prefix}/{key}"
        return self.store.get(k).decode() if self.store.check([k]) else None

    def post_exchange(self, era_: int, calls: int) -> None:
        self.store.set(f"{self.prefix}/x/{self.rank}", f"{era_}:{calls}")

    def exchanging(self, r: int, era_: int, calls: int) -> bool:
        return self._get(f"x/{r}") == f"{era_}:{calls}"

    def post_refusal(self, era_: int, calls: int, state: str, why: str) -> None:
        self.store.set(f"{self.prefix}/r/{self.rank}", f"{era_}:{calls}:{state}:{why}")
        if state == "pending":
            self.store.add(f"{self.prefix}/n", 1)

    def refusal(self, r: int, era_: int) -> tuple[int, str, str] | None:
        """(call, state, why) of group rank ``r``'s latest refusal in ``era_``, else None."""
        v = self._get(f"r/{r}")
        if v is None:
            return None
        e, c, state, why = v.split(":", 3)
        return (int(c), state, why) if int(e) == era_ else None

    def any_refused(self) -> bool:
        return self.store.add(f"{self.prefix}/n", 0) > 0


def _store() -> Any:
    from .. import dist

    ctx = dist.get_context()
    if ctx is not None and getattr(ctx, "_store", None) is not None:
        return ctx._store
    import torch.distributed as tdist

    return tdist.PrefixStore("overlap", tdist.distributed_c10d._get_default_store())


def _runtime_of(ranks: tuple[int, ...]) -> Any:
    """The group's runtime on this rank's current GPU, if one was made."""
    if not torch.cuda.is_available():
        return None
    from . import _runtime

    return _runtime._runtimes.get((ranks, torch.cuda.current_device()))


def _capable(st: _agree.GroupStep) -> bool:
    """Whether the group has a tile-flag path on this rank (a peer heap or an NCCL
    communicator): alike on every rank, as both are made by collective calls."""
    rt = _runtime_of(st.ranks)
    return rt is not None and (rt._heap is not None or bool(rt._comms))


def board_of(st: _agree.GroupStep, group: Any) -> Board | None:
    """The ``Board`` of ``group`` (``st`` its step), where it has a tile-flag path; else None."""
    if len(st.ranks) < 2 or not _capable(st):
        return None
    if st.board is None:
        try:
            st.board = Board(_store(), st.ranks, st.rank, str(getattr(group, "group_name", "") or ""))
        except Exception:  # noqa: BLE001 - no store to reach: refusals take the exchange, as before
            st.board = False
    return st.board or None


def _bound_s(group: Any) -> float:
    return _flags.default_timeout_ms(group) / 1000.0


def decide(board: Board, era_: int, calls: int, moving: Callable[[], bool] | None, bound_s: float) -> str:
    """Where the peers of a rank that refused call ``calls`` are: "exchange" (every peer
    posted P at this call, or is refusing it too: all meet in the exchange), "band" (a peer
    refused it in band, or ``moving()``: a peer's data of this call landed), "late" (none
    of these within ``bound_s``). Polls the store (and ``moving``) every ``POLL_S``."""
    peers = [r for r in range(len(board.ranks)) if r != board.rank]
    deadline = time.monotonic() + bound_s
    while True:
        ready = 0
        for r in peers:
            rec = board.refusal(r, era_)
            if rec is not None and rec[0] == calls and rec[1] in ("band", "late"):
                return "band"
            if board.exchanging(r, era_, calls) or (rec is not None and rec[0] == calls and
                                                    rec[1] in ("pending", "exchange")):
                ready += 1
        if ready == len(peers):
            return "exchange"
        if moving is not None and moving():
            return "band"
        if time.monotonic() > deadline:
            return "late"
        time.sleep(POLL_S)


def before_exchange(st: _agree.GroupStep, group: Any, op: str) -> None:
    """At every exchange of a group with a tile-flag path: post P, then end the group here
    (``RanksRefusedError``) if a peer refused a call in band; a peer still deciding this
    call ("pending") is waited for, bounded."""
    board = board_of(st, group)
    if board is None:
        return
    er, calls = era(st.ranks), st.calls
    try:
        board.post_exchange(er, calls)
        if not board.any_refused():
            return
    except Exception:  # noqa: BLE001 - the store is gone: so is any refusal's post (the exchange as before)
        return
    deadline = time.monotonic() + _bound_s(group) + 5.0
    for r in range(len(st.ranks)):
        if r == st.rank:
            continue
        try:
            rec = board.refusal(r, er)
            while rec is not None and rec[1] == "pending" and time.monotonic() < deadline:
                time.sleep(POLL_S)
                rec = board.refusal(r, er)
        except Exception:  # noqa: BLE001 - the store is gone: the refusing rank falls back to the exchange too
            return
        if rec is None or rec[1] == "exchange":
            continue
        c, state, why = rec
        if state == "pending":
            st.broken = f"group rank {r} did not decide its refusal of call {c} within the bound"
        else:
            st.broken = f"group rank {r} refused call {c} of the group's ops in band ({why})"
        raise _flags.RanksRefusedError(f"{op}: group rank {st.rank}: {st.broken}; the group's ops are ended on every "
                                       "rank and no rank ran this call: call overlap.reset(group) on every rank to "
                                       "go on")


def refuse_in_band(cs: _agree.call_step, error: BaseException) -> bool:
    """The refusing rank's side (``overlap.ops._agree.refuse``): False where the refusal
    goes through the exchange (no tile-flag path, or the peers are there); True where it
    went in band: the records are written, the group is ended here and a note on
    ``error`` says so (the caller raises it)."""
    st = cs.step
    board = board_of(st, cs.group)
    if board is None:
        return False
    er, calls = era(st.ranks), st.calls
    why = f"{type(error).__name__}: {error}"
    rt = _runtime_of(st.ranks)
    bound = _bound_s(cs.group)
    try:
        board.post_refusal(er, calls, "pending", why)
        way = decide(board, er, calls, _moving_probe(rt, _data_op(rt, cs.op)), bound)
    except Exception:  # noqa: BLE001 - no store: the exchange, as before (bounded by the group's timeout)
        return False
    if way == "exchange":
        try:
            board.post_refusal(er, calls, "exchange", why)
        except Exception:  # noqa: BLE001 - the peers' reads fail alike and they go to the exchange
            pass
        return False
    try:
        board.post_refusal(er, calls, way, why)  # before the records: a peer that reads one finds the message
    except Exception:  # noqa: BLE001 - the records still name the rank and its error's type
        pass
    word = P.refusal_word(st.rank, calls, type(error).__name__)
    wrote = _write_in_band(rt, word, bound)
    late = "" if way == "band" else f"no peer reached this call within the wait bound ({bound:.0f} s); "
    st.broken = f"group rank {st.rank} refused call {calls} ({cs.op}) at a signature agreed before"
    note = (f"{cs.op}: group rank {st.rank}: the peers were already in this call's data movement (a signature "
            f"agreed before makes no exchange); {late}the refusal went to them through "
            f"{'peer memory (' + ', '.join(wrote) + ') and ' if wrote else ''}the job's store. The group's ops are "
            "ended on every rank: call overlap.reset(group) on every rank to go on")
    if hasattr(error, "add_note"):
        error.add_note(note)
    return True


def _data_op(rt: Any, op: str) -> str:
    """The op whose peer-copy flags a call of ``op`` moves data under: itself, but the block
    boundary's in shared-GPU mode, where it runs ``matmul_all_reduce`` (``boundary._shared_gpu``)."""
    if op == "matmul_all_reduce_matmul" and getattr(rt, "shared_gpu", False):
        return "matmul_all_reduce"
    return op


def _moving_probe(rt: Any, op: str) -> Callable[[], bool] | None:
    """A poll that is True once a peer's push of ``op``'s next call landed in this rank's
    flags (any chunk flag of a peer's region at that call's epoch); None where ``op`` has
    not run on the peer-copy transport here (then no peer can be moving its data)."""
    heap = getattr(rt, "_heap", None)
    sf = heap._flags.get(op) if heap is not None else None
    if sf is None or op not in SENDER_REGIONS:
        return None
    from .._p2p import flag_stride

    world, me = rt.world, rt.rank
    stride = flag_stride(world)
    idx = torch.tensor([sender_region(op, p, me, world) * stride + j for p in range(world) if p != me
                        for j in range(stride - 2)])
    epoch = _flags.wrap32(sf.epoch + 1)
    side = torch.cuda.Stream(device=rt.device)

    def moving() -> bool:
        with torch.cuda.stream(side):
            v = sf.local.to("cpu")[idx].long()
        return bool((((v - epoch) & 0xFFFFFFFF) < (1 << 31)).any())

    return moving


def _write_in_band(rt: Any, word: int, bound_s: float) -> list[str]:
    """``write_in_band`` where the group has a peer heap here; the ops whose regions it wrote."""
    if getattr(rt, "_heap", None) is None:
        return []
    return write_in_band(rt, word, bound_s)


def write_in_band(rt: Any, word: int, bound_s: float) -> list[str]:
    """In every peer's flags, for every op of ``SENDER_REGIONS`` that ran here: this rank's
    signature word of the op's next call := ``word``, then every chunk flag of its region :=
    that call's epoch; queued on the comm stream after the op's previous call here. Waits
    (polled, at most ``bound_s``) for the writes to land. Returns the ops written."""
    from .._p2p import flag_stride

    heap, world, me = rt._heap, rt.world, rt.rank
    stride = flag_stride(world)
    cur = torch.cuda.current_stream(rt.device)
    cs = rt.comm_stream
    done: list[str] = []
    with rt.order.lock:
        rt.order.begin(cur)
        try:
            rt.fork(cur, cs)
            for name, sf in list(heap._flags.items()):
                if name not in SENDER_REGIONS:
                    continue
                prev = rt._p2p_done.get(name)
                if prev is not None:
                    cs.wait_event(prev[0])
                epoch = _flags.wrap32(sf.epoch + 1)
                for q in range(world):
                    if q == me:
                        continue
                    base = sender_region(name, me, q, world) * stride
                    _flags.stream_write_value(cs, sf.peer(q), base + stride - 1 - (epoch & 1), word)
                    for j in range(stride - 2):
                        _flags.stream_write_value(cs, sf.peer(q), base + j, epoch)
                done.append(name)
            rt.join(cur, cs)
        finally:
            rt.order.end(cur)
    ev = torch.cuda.Event()
    ev.record(cur)
    deadline = time.monotonic() + bound_s
    while not ev.query() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return done


def _on_peer_refusal(err: Any, exc: _flags.PeerRefusedError) -> None:
    """``overlap.flags.refusal_hooks``: a kernel found a peer's refusal record. End the
    group here (its ops raise ``RanksOutOfStepError`` before any collective until
    ``reset``) and add the refusing rank's message from the store."""
    ranks = getattr(err, "ranks", None)
    if ranks is None:
        return
    for group, st in list(_agree._steps.values()):
        if st.ranks != ranks:
            continue
        st.broken = f"group rank {exc.refuser} refused a call of the group's ops in band ({exc.kind})"
        try:
            board = board_of(st, group)
            rec = board.refusal(exc.refuser, era(ranks)) if board is not None else None
        except Exception:  # noqa: BLE001 - the record alone still names the rank and its error's type
            rec = None
        if rec is not None and (rec[0] & 0xFFFF) == exc.calls:
            exc.explain(f"call {rec[0]}: {rec[2]}")
            st.broken = f"group rank {exc.refuser} refused call {rec[0]} of the group's ops in band ({rec[2]})"


_flags.refusal_hooks.append(_on_peer_refusal)
