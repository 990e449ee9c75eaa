"""The ranks' agreement on each call: one exchange that carries every rank's verdict.

A call of a group op is a sequence of collectives, and every rank must make the same
sequence: a rank that leaves it (raises before a collective its peers enter) makes a
peer's collective pair with whatever comes next, which is an abort, a hang or a wrong
result. So every call of a group op runs in this order:

    with call_step(group, op):           # the group's step on this rank, one call at a time
        ...every check that can refuse the call (no collective yet)...
        agreement point                  # exchange: counter, verdict, thread, op, signature
        ...the data collectives...

A check that refuses the call does not raise at once: its error is the call's verdict,
which goes into the exchange (``refuse``), and every rank raises after it: the refusing
rank its own error, the others ``RanksRefusedError`` naming the rank and why. The
exchange also carries the group's call counter on this rank (every call counts, at its
agreement point, whether it exchanged or not), so ranks whose calls got out of step are
caught at the next exchange (``RanksOutOfStepError``), and the calling thread with its
own count of calls, so that a call is never paired with another thread's call, nor with
another call of its own thread.

An exception between the exchange and the call's data collective (a KeyboardInterrupt,
an out-of-memory) leaves this rank a collective behind its peers: the group is then ended
on this rank (``GroupStep.broken``): every later call raises ``RanksOutOfStepError`` before
any collective, until ``overlap.reset(group)`` (collective) or ``overlap.dist.shutdown``.

A refusal at a signature agreed before, where the peers make no exchange and are already in
the call's data movement, takes another way (in band, through peer memory and the job's
store): ``overlap.ops._refusal``. What is and is not caught without a per-call exchange:
docs/guarantees.md, "Ranks that disagree, refuse, or get out of step".
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections import OrderedDict
from typing import Any

import torch

from ..flags import PeerRefusedError, RanksRefusedError  # defined below the ops' layer (the kernels raise one)

__all__ = ["RanksRefusedError", "PeerRefusedError", "RanksOutOfStepError", "SUPPORTED_DTYPES", "dtype_code",
           "check_dtype", "float_code", "GroupStep", "group_step", "call_step", "agreement", "refuse",
           "collective_done", "agree_extra", "reset_steps", "group_call", "named", "name_op", "step_of",
           "raise_in_step", "count_call", "agreed_before", "WIDTH"]


class RanksOutOfStepError(RuntimeError):
    """The ranks' calls of the group's ops got out of step (a call made on some ranks only,
    an exception between two collectives of a call, calls of two threads), or the group was
    ended on this rank after such an event: no collective of this call was made."""


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes the ops take (the tile-flag path: float16 and bfloat16; the reference: all four)."""

WIDTH = 40
"""Int64 words one rank sends in an exchange (fixed, whatever the op or the verdict: a
refusing rank that has no signature sends as many words as its peers)."""
_HEAD = 7  # magic, call counter, verdict, thread, op, the thread's call counter, number of values
_MAGIC = 0x0A9EE5
_VERDICTS = {ValueError: 1, TypeError: 2, RuntimeError: 3}


def dtype_code(dtype: torch.dtype) -> int:
    """A number for ``dtype`` that every process computes alike (CRC-32 of its name; never
    Python's ``hash``, which differs between processes)."""
    return zlib.crc32(str(dtype).encode())


def float_code(x: float) -> int:
    """A float as the int64 of its IEEE bits (an exchange carries ints; eps of 1e-5 and 1e-6 differ)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def check_dtype(op: str, name: str, dtype: torch.dtype) -> None:
    """TypeError naming ``op`` where ``dtype`` is not one the ops take."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: {name} is {dtype}; the ops take float16, bfloat16 (the tile-flag path), float32 "
                        "or float64 (the reference path)")


_move_to_end = OrderedDict.move_to_end


def _thread_code() -> int:
    """The calling thread, as the exchange compares it: 0 for the main thread, 1 for a
    thread Python did not start (autograd's device threads), else a CRC-32 of its name
    (Python's default names match between ranks whose threads are made in the same order).
    Made once per thread."""
    code = getattr(_tls, "code", None)
    if code is None:
        t = threading.current_thread()
        if t is threading.main_thread():
            code = 0
        elif isinstance(t, threading._DummyThread):  # type: ignore[attr-defined]
            code = 1
        else:
            code = 2 + zlib.crc32(t.name.encode())
        _tls.code = code
    return code


class GroupStep:
    """This rank's place in the sequence of its group's op calls.

    ``calls``: calls that reached their agreement point (every rank counts the same
    ones, whether the call exchanged or not); ``lock``: held for a whole call, so a
    call's collectives are never interleaved with another thread's; ``pending``: the op
    whose exchange is done and whose data collective is not issued yet; ``broken``: why
    the group is ended on this rank (None: it is not)."""

    __slots__ = ("ranks", "rank", "calls", "by_thread", "lock", "broken", "pending", "busy", "depth", "board")

    def __init__(self, ranks: tuple[int, ...], rank: int) -> None:
        self.ranks, self.rank = ranks, rank
        self.calls = 0
        self.by_thread: dict[int, int] = {}
        """Calls counted per calling thread (``_thread_code``): two calls of one thread are
        never paired across ranks, whatever the other threads did between them."""
        self.lock = threading.RLock()
        self.broken: str | None = None
        self.pending: str | None = None
        self.busy: str | None = None  # the op of the call in flight (for the thread refusal's message)
        self.depth = 0
        self.board: Any = None  # the group's keys in the job's store (``overlap.ops._refusal.Board``)


_steps: dict[int, tuple[Any, GroupStep]] = {}
"""By ``id(group)`` (the group held, so the id stays its own): a step per communicator, as two
groups of the same ranks make their collectives apart."""
_steps_lock = threading.Lock()
_tls = threading.local()


def group_step(group: Any) -> GroupStep:
    """The ``GroupStep`` of ``group`` (resolved: a process group) on this rank."""
    hit = _steps.get(id(group))
    if hit is not None and hit[0] is group:
        return hit[1]
    from ._runtime import group_key

    ranks, rank = group_key(group)  # ValueError for a process outside the group
    with _steps_lock:
        hit = _steps.get(id(group))
        if hit is None or hit[0] is not group:
            hit = _steps[id(group)] = (group, GroupStep(ranks, rank))
    return hit[1]


def reset_steps(ranks: tuple[int, ...] | None = None) -> None:
    """Forget the steps of the groups of ``ranks`` (all groups: None): counters from 0, the
    group no longer ended. Every rank of the group must do it at the same point
    (``overlap.reset``, ``overlap.dist.shutdown``)."""
    _refusal.next_era(ranks)  # a refusal posted before this reset never matches a later call
    with _steps_lock:
        if ranks is None:
            _steps.clear()
            return
        for _, st in _steps.values():
            if st.ranks == ranks:
                with st.lock:
                    st.calls, st.broken, st.pending = 0, None, None
                    st.by_thread.clear()


def _count(st: GroupStep) -> None:
    """One more call of the group, and of the calling thread, on this rank."""
    st.calls += 1
    code = _thread_code()
    st.by_thread[code] = st.by_thread.get(code, 0) + 1


def count_call(group: Any) -> None:
    """Count the call in flight as its agreement point would, with no exchange (a call
    captured in a CUDA graph: its eager call agreed)."""
    cs = _current(group)
    _count(cs.step if cs is not None else group_step(group))


class call_step:
    """``with call_step(group, op):`` around one call of a group op (see the module
    docstring). On entry: the group's lock (a call that finds another thread's call in
    flight waits for it, and is then refused on every rank: the two threads' calls may be
    in another order on the peers); a group ended on this rank raises
    ``RanksOutOfStepError`` here, before any collective. On exit with an exception
    between the exchange and the data collective, the group is ended on this rank."""

    __slots__ = ("group", "op", "step", "contended", "calls0", "outer", "_prev", "mirror", "untracked")

    def __init__(self, group: Any, op: str, mirror: Any = None) -> None:
        self.group, self.op = group, op
        # the call's input, where the op's first call on a group's tile-flag path opens peer
        # memory (a collective) before the agreement: a refusal of such an input makes it too
        self.mirror = mirror

    def __enter__(self) -> "call_step":
        try:
            st = self.step = group_step(self.group)
        except (ValueError, TypeError) as e:
            # no collective can be made: this error stays on this rank
            outside = "member" in str(e) or "not in the group" in str(e)
            raise type(e)(f"{self.op}: {'this process is not in the group: ' if outside else ''}{e}") from None
        self.contended = None
        if not st.lock.acquire(blocking=False):
            busy = st.busy
            st.lock.acquire()
            self.contended = (f"{self.op}: group rank {st.rank}: called while a call of {busy or 'an op'} on the "
                              "same group was in flight in another thread; the order of two threads' calls is not "
                              "the same on every rank, so the ops take one call of a group at a time (call them "
                              "from one thread, or order the threads' calls yourself)")
        self.outer = st.depth == 0
        st.depth += 1
        if self.outer:
            st.busy = self.op
        self.calls0 = st.calls  # moved on by this call's agreement point (or a nested call's)
        # set by the agreement of a tile-flag call at more than one rank: its data moves on
        # side streams and peer memory, where the host does not follow each collective
        self.untracked = False
        self._prev = getattr(_tls, "cur", None)
        _tls.cur = self
        if st.broken is not None:
            self._leave()
            raise RanksOutOfStepError(f"{self.op}: group rank {st.rank}: the group's ops are out of step on this "
                                      f"rank ({st.broken}); no collective was made. Call overlap.reset(group) on "
                                      "every rank (or overlap.dist.shutdown()) to go on")
        return self

    def _leave(self) -> None:
        st = self.step
        _tls.cur = self._prev
        st.depth -= 1
        if self.outer:
            st.busy = None
        st.lock.release()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        st = self.step
        if self.outer and exc_type is not None:
            name_op(exc, self.op)
        try:
            if exc_type is not None and st.pending is not None:
                # this rank made the exchange and not the data collective its peers made (or
                # that collective failed): its next collective would pair with the wrong one
                st.broken = (f"group rank {st.rank}: {exc_type.__name__} between the agreement and the data "
                             f"collective of call {st.calls} ({st.pending})")
                st.pending = None
                if isinstance(exc, Exception) and not isinstance(exc, RanksOutOfStepError):
                    raise RanksOutOfStepError(f"{self.op}: {st.broken}: {exc}; the group's ops are ended on this "
                                              "rank: call overlap.reset(group) on every rank (or "
                                              "overlap.dist.shutdown())") from exc
            elif exc_type is not None and self.untracked and not isinstance(exc, Exception):
                # a KeyboardInterrupt after a tile-flag call's agreement, on this rank: its
                # peers may be in the call's data movement, which this rank's next call would
                # pair with (the peer-copy transport takes the call's epoch back)
                st.broken = (f"group rank {st.rank}: {exc_type.__name__} after the agreement of call {st.calls} "
                             f"({self.op}) on the tile-flag path")
            elif exc_type is not None and st.calls == self.calls0 and self.outer:
                if isinstance(exc, Exception) and not isinstance(exc, (RanksRefusedError, RanksOutOfStepError)) \
                        and not _is_capture_error(exc) and not _outside_group(exc):
                    # a check refused the call before its agreement point: the refusal is the
                    # call's verdict, exchanged with the peers, who raise with this rank
                    refuse(self, exc)
                elif not isinstance(exc, Exception):
                    # a KeyboardInterrupt before the agreement point: no exchange (it would
                    # wait for the peers), but the call is spent on this rank, so the next
                    # exchange finds the counters apart instead of pairing two calls
                    _count(st)
        finally:
            self._leave()
        return False


def name_op(exc: BaseException, op: str) -> None:
    """Prefix ``op`` to the message of a plain ValueError, TypeError or RuntimeError that
    does not name it (one raised by torch or by a shared check inside the op), so that every
    error of a call names its op."""
    if type(exc) in (ValueError, TypeError, RuntimeError, NotImplementedError) and exc.args \
            and isinstance(exc.args[0], str) and op not in exc.args[0]:
        exc.args = (f"{op}: {exc.args[0]}",) + exc.args[1:]


def named(op: str) -> Any:
    """Decorator of an op that takes no group (the chain): its errors name it (``name_op``)."""
    import functools

    def deco(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kw: Any) -> Any:
            try:
                return fn(*args, **kw)
            except Exception as e:
                name_op(e, op)
                raise
        return call
    return deco


def group_call(op: str, opens_p2p: bool = True) -> Any:
    """Decorator of a group op's public function (its ``group`` keyword resolved here):
    the call runs inside ``call_step(group, op)``. ``opens_p2p``: the op's first call on a
    group's tile-flag path opens peer memory before its agreement (``Runtime.p2p``)."""
    import functools

    def deco(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, group: Any = None, **kw: Any) -> Any:
            if not _initialized():  # no group: the op's checks, then its clear error
                try:
                    return fn(*args, group=group, **kw)
                except Exception as e:
                    name_op(e, op)
                    raise
            g = _resolve(group)
            with call_step(g, op, args[0] if opens_p2p and args else None):
                return fn(*args, group=g, **kw)
        return call
    return deco


def _tile_flag_input(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def step_of(group: Any, op: str, x: Any = None) -> Any:
    """``call_step(group, op)`` for a caller above the ops (the N-D wrappers: their own
    checks come before the op's; ``x`` the op's input); a no-op context where no process
    group is initialized."""
    if not _initialized():
        import contextlib

        return contextlib.nullcontext()
    return call_step(_resolve(group), op, None if op == "matmul_all_reduce_matmul" else x)


def raise_in_step(group: Any, op: str, error: BaseException, x: Any = None) -> None:
    """Raise ``error``, a refusal found above the op (``x`` its input), as the op's
    refusals are: through the agreement exchange, so the peers raise with this rank."""
    with step_of(group, op, x):
        raise error


_is_init: list[Any] = []


def _initialized() -> bool:
    if not _is_init:
        import torch.distributed as tdist

        _is_init.append(tdist.is_initialized if tdist.is_available() else (lambda: False))
    return _is_init[0]()


def _resolve(group: Any) -> Any:
    if group is not None:
        return group
    if not _resolver:  # (an import statement per call cost about 1 us: the function is kept)
        from ._runtime import resolve_group

        _resolver.append(resolve_group)
    return _resolver[0](None)


_resolver: list[Any] = []


def _is_capture_error(e: BaseException) -> bool:
    from ._runtime import OverlapCaptureError, capturing

    return isinstance(e, OverlapCaptureError) or capturing()


def _outside_group(e: BaseException) -> bool:
    return isinstance(e, ValueError) and "is not in the group" in str(e)


class agree_extra:
    """``with agree_extra(names, values):`` adds values to the agreement of the op call made
    inside (the N-D wrappers: the leading shape and the gathered or scattered dim, which the
    2-D op does not see)."""

    __slots__ = ("extra", "prev")

    def __init__(self, names: tuple[str, ...], values: tuple[int, ...]) -> None:
        self.extra = (names, values)

    def __enter__(self) -> None:
        self.prev = getattr(_tls, "extra", None)
        _tls.extra = self.extra

    def __exit__(self, *exc: Any) -> None:
        _tls.extra = self.prev


def _current(group: Any) -> call_step | None:
    """The op call in flight in this thread, if any (its agreement may name the group by
    another object of the same ranks: the runtime's)."""
    return getattr(_tls, "cur", None)


def agreement(group: Any, world: int, device: torch.device, op: str, names: tuple[str, ...],
              values: tuple[int, ...], *, agreed: Any = None, key: Any = None, every: bool = False,
              then_collective: bool = True) -> bool:
    """The call's agreement point (see the module docstring). ``agreed``/``key``: the
    runtime's cache of agreed signatures; a key found there skips the exchange (the fast
    path: no collective) unless ``every``. Returns True where it exchanged. ``then_collective``:
    the call's data collective follows on torch's group (the reference path), so an
    exception before it ends the group on this rank.

    Raises on every rank alike: the refusing rank's own error, ``RanksRefusedError``,
    ``RanksOutOfStepError``, or ValueError "ranks disagree on (...)"."""
    cs = _current(group)
    extra = getattr(_tls, "extra", None)
    if extra is not None:
        _tls.extra = None  # for the first agreement inside the wrapper only
        names, values = names + extra[0], tuple(values) + tuple(extra[1])
        if key is not None:
            key = (key, extra[1])
    st = cs.step if cs is not None else group_step(group)
    _count(st)
    # one rank alone: no peer whose calls could be in another order
    contended = cs.contended if cs is not None and world > 1 else None
    if cs is not None and not then_collective and world > 1:
        cs.untracked = True
    if contended is None and agreed is not None and not every:
        try:  # (a key agreed before, marked used: one C call, as the call plans' index marks its hits)
            _move_to_end(agreed, key)
            return False
        except KeyError:
            pass
    refusal = ValueError(contended) if contended is not None else None
    if refusal is not None and cs is not None and _refusal.refuse_in_band(cs, refusal):
        raise refusal  # the peers were in the call's data movement: refused in band, the group ended
    _exchange(st, group, world, device, op, names, values, refusal)
    if agreed is not None:
        agreed.add(key)
    if then_collective and world > 1:
        st.pending = op
    return True


def agreed_before(agreed: Any, world: int, key: Any) -> bool:
    """``agreement``'s fast path for a call plan's call (``then_collective=False``, not
    every call checked) in one frame: where a call is in flight in this thread with no
    extra values to exchange and no contention to report, and ``key`` is in ``agreed``,
    the call is counted, ``key`` marked used, and True returned; else nothing is done and
    False returned (the caller then calls ``agreement``, which decides as before)."""
    cs = getattr(_tls, "cur", None)
    if cs is None or getattr(_tls, "extra", None) is not None or (world > 1 and cs.contended is not None):
        return False
    try:
        _move_to_end(agreed, key)
    except KeyError:
        return False
    _count(cs.step)
    if world > 1:
        cs.untracked = True
    return True


def collective_done() -> None:
    """The call's data collective is issued (the reference path calls it after its
    collective): an exception from here on leaves the ranks in step."""
    cs = getattr(_tls, "cur", None)
    if cs is not None:
        cs.step.pending = None


def refuse(cs: call_step, error: BaseException) -> None:
    """Exchange the refusal ``error`` of the call ``cs`` at its agreement point: every
    rank raises (this one ``error``, re-raised by the caller)."""
    st = cs.step
    _count(st)
    try:
        import torch.distributed as tdist

        world = tdist.get_world_size(cs.group)
    except Exception:  # noqa: BLE001 - no group to tell: the error stands alone
        return
    if world == 1:
        return
    _mirror_first_collectives(cs)
    if _refusal.refuse_in_band(cs, error):
        return  # the peers were in the call's data movement: refused in band, the group ended
    _exchange(st, cs.group, world, _exchange_device(cs.group), cs.op, (), (), error)


def _mirror_first_collectives(cs: call_step) -> None:
    """A GPU call's first collective on a group is the peer-memory check
    (``Runtime.p2p``), made before the agreement point by the ops that have a peer-copy
    transport; a rank that refused such a call (its input on the tile-flag path's device
    and dtype) makes it too, so that its refusal meets the peers' exchange, not that check."""
    if not _tile_flag_input(cs.mirror) or not torch.cuda.is_available():
        return
    from ._runtime import get_runtime_if_made

    rt = get_runtime_if_made(cs.group, torch.device("cuda", torch.cuda.current_device()))
    if rt is not None and rt._p2p_why is not None:
        return  # decided by an earlier call: the peers (in step) decided it then too
    from ._runtime import get_runtime

    rt = get_runtime(cs.group, torch.device("cuda", torch.cuda.current_device()))
    if cs.op in NCCL_ONLY and not (rt.shared_gpu and rt.world > 1):
        return  # on the NCCL transport the op opens no peer memory
    rt.p2p()


NCCL_ONLY = ("matmul_all_reduce_matmul",)
"""Ops with no peer-copy transport of their own, that open peer memory only in shared-GPU
mode (there the block boundary runs ``matmul_all_reduce`` on the peer-copy transport)."""


def _exchange_device(group: Any) -> torch.device:
    import torch.distributed as tdist

    if tdist.get_backend(group) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange(st: GroupStep, group: Any, world: int, device: torch.device, op: str, names: tuple[str, ...],
              values: tuple[int, ...], refusal: BaseException | None) -> None:
    from ._runtime import gather_ints

    if len(values) > WIDTH - _HEAD:
        raise AssertionError(f"{op}: {len(values)} values to agree on, the exchange holds {WIDTH - _HEAD}")
    _refusal.before_exchange(st, group, op)  # a group with a tile-flag path: post P, read the refusals
    verdict = 0 if refusal is None else next((c for t, c in _VERDICTS.items() if isinstance(refusal, t)), 3)
    opc = zlib.crc32(op.encode())
    code = _thread_code()
    mine = [_MAGIC, st.calls, verdict, code, opc, st.by_thread.get(code, 0), len(values), *(int(v) for v in values)]
    mine += [0] * (WIDTH - len(mine))
    try:
        rows = gather_ints(group, world, mine, device)
    except Exception as e:
        st.broken = f"group rank {st.rank}: the agreement exchange of call {st.calls} ({op}) failed: {e}"
        raise RanksOutOfStepError(f"{op}: {st.broken}; the group's ops are ended on this rank: call "
                                  "overlap.reset(group) on every rank (or overlap.dist.shutdown())") from e
    if any(r[0] != _MAGIC for r in rows) or any(r[1] != rows[0][1] for r in rows):
        counts = [r[1] if r[0] == _MAGIC else None for r in rows]
        st.broken = (f"the ranks' calls are out of step: group ranks at call {counts} of the group's ops (None: "
                     "a rank in another collective)")
        raise RanksOutOfStepError(f"{op}: {st.broken}; a rank made a call its peers did not, or left one between "
                                  "two collectives. The group's ops are ended: call overlap.reset(group) on every "
                                  "rank (or overlap.dist.shutdown())")
    refused = [i for i, r in enumerate(rows) if r[2]]
    if refused:
        import torch.distributed as tdist

        whys: list[Any] = [None] * world
        tdist.all_gather_object(whys, None if refusal is None else f"{type(refusal).__name__}: {refusal}",
                                group=group)
        if refusal is not None:
            raise refusal
        told = "; ".join(f"group rank {i}: {whys[i]}" for i in refused)
        raise RanksRefusedError(f"{op}: refused on group rank{'s' if len(refused) > 1 else ''} "
                                f"{refused[0] if len(refused) == 1 else refused}, so no rank ran this call ({told})")
    if any(r[4] != opc for r in rows):
        raise ValueError(f"{op}: ranks disagree on the op: group rank 0 calls another op than group ranks "
                         f"{[i for i, r in enumerate(rows) if r[4] != rows[0][4]]} at call {st.calls}")
    if any(r[3] != rows[0][3] for r in rows):
        bad = [i for i, r in enumerate(rows) if r[3] != rows[0][3]]
        raise ValueError(f"{op}: ranks disagree on the calling thread: group ranks {bad} made this call from "
                         "another thread than group rank 0 (threads that call the ops must have the same names on "
                         "every rank and make their calls in the same order)")
    if any(r[5] != rows[0][5] for r in rows):
        raise ValueError(f"{op}: ranks disagree on the calling thread's call: group ranks made their "
                         f"{[r[5] for r in rows]}-th call of this thread here (calls of one thread paired "
                         "with another call of it: the threads' calls came in another order on some rank)")
    got = [r[_HEAD:_HEAD + r[6]] for r in rows]
    if any(v != got[0] for v in got):
        bad = [i for i, v in enumerate(got) if v != got[0]]
        raise ValueError(f"{op}: ranks disagree on ({', '.join(names)}): {got} (rank order of the group; "
                         f"group ranks {bad} differ from group rank 0)")


from . import _refusal  # noqa: E402 - a refusal's other way, in band (it imports this module)
