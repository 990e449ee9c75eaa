"""The call frame every fused op shares: the observed call, the plans of its GEMMs, the
frame of one call on the NCCL transport (``fused_call``) and its error report."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import flags as _flags
from .. import observe as _observe
from ._config import OverlapConfig
from ._state import capturing, keep_for_capture

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = ["observed", "serial_phases", "bucketed", "plan_rows_for", "gemm_plan", "fused_call", "report_errors", "report_eager",
           "wait_count"]


def observed(op: str, shape: tuple, path: str, why: str, device: torch.device, fn: Any, *args: Any,
             serial: bool = False) -> Any:
    """``fn(*args)``, one call of ``op`` on ``path`` (``overlap.observe``): a profiler range
    named ``overlap.<op>[<path>]``, the call counted in ``overlap.report()`` with ``why``,
    and, while profiling is on, the call's span on the caller's stream timed by CUDA
    events (read when the report is made, never waited on). Off: a counter and a shared
    no-op range, well under a microsecond."""
    with _observe.op_range(op, path):
        _observe.record_call(op, shape, path, why)
        # the switch first: with profiling off nothing else is looked at
        tm = _observe.timer(op, shape, path, serial=serial) if _observe._enabled and device.type == "cuda" else None
        if not tm:
            return fn(*args)
        cur = torch.cuda.current_stream(device)
        tm.start("op", cur)
        out = fn(*args)
        tm.stop("op", cur)
        tm.commit()
        return out


def serial_phases(op: str, shape: tuple, path: str, device: torch.device) -> Any:
    """A timer for a call that runs its communication and GEMM one after the other (the
    references): their spans are the alone-times of the report's hidden fraction. Falsy
    (a no-op) unless profiling is on and the call is on CUDA."""
    return _observe.timer(op, shape, path, serial=True) if _observe._enabled and device.type == "cuda" else None


def bucketed(cfg: OverlapConfig | None, transport: str) -> int:
    """1 where a call's plan is made per row bucket (``plan_rows_for``: the NCCL transport
    with a per-tile GEMM), else 0; one of the values the ranks agree on (their NCCL calls'
    sizes come from the bucket's chunks, or from M's)."""
    return int(cfg is not None and transport == "nccl" and not (cfg.gemm is not None and cfg.gemm.flatten))


def plan_rows_for(rows: int, cfg: OverlapConfig, transport: str) -> int:
    """The rows (M, or M/R of a gathered op) a consumer op's plan is made for: on the
    NCCL transport with a per-tile GEMM, ``policies.plan_rows(rows)``: one plan (chunks,
    tile table, launches) per row bucket, the GEMM cutting its tiles at the call's rows
    (``launch_tile_gemm(rows=)``), so a new M of a bucket seen before costs no plan; else
    ``rows`` itself (the peer-copy transport's pushes and a flattened GEMM's groups are
    laid out for exact rows)."""
    from ..policies import plan_rows

    return plan_rows(rows) if bucketed(cfg, transport) else rows


def gemm_plan(plans: dict, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, table: torch.Tensor, *,
              flags: torch.Tensor, err: torch.Tensor, timeout_ns: int, counter: torch.Tensor | None = None,
              **kw: Any) -> Any:
    """The GEMM plan in ``plans`` (an op plan's own ``LRU``) for these operands'
    dtype, B's layout (each weight's, for a list of them), the wait bound, the table (a part
    of the op plan's, for a grid over some of its rows), the flag, error and counter
    tensors and the GEMM engine asked for (``OVERLAP_GEMM_ENGINE``); made on first use: a
    ``TileGemmPlan``, or where the Gluon GEMM can run the call an ``engine.EnginePlan``
    (same methods; it picks its engine at its first launch, ``overlap.kernels.engine``;
    ``tile_only="why"``: the tile GEMM whatever the setting, for that reason).
    The op plan fixes everything else (shapes, table, config, rank); with ``clip`` (a plan
    of a row bucket) not A's rows, which each launch gives (``launch(rows=)``)."""
    from ..kernels.engine import ahead, engine_mode, experimental

    b_strides = tuple(x.stride() for x in b) if isinstance(b, list) else b.stride()
    key = (a.dtype, b_strides, timeout_ns, table.data_ptr(), table.shape[0], flags.data_ptr(), err.data_ptr(),
           counter.data_ptr() if counter is not None else 0, bool(kw.get("norm_epi")), kw.get("split"),
           kw.get("sig_stride"), kw.get("clip") or None, engine_mode(), kw.get("tile_only"), experimental(),
           ahead())
    gp = plans.get(key)
    if gp is None:
        from ..kernels.engine import engine_plan

        gp = plans[key] = engine_plan(a, b, c, table, flags=flags, err=err, timeout_ns=timeout_ns,
                                      counter=counter, **kw)
    # a captured launch reads the plan's table and split workspace on every replay: never freed
    return keep_for_capture(gp)


class fused_call:
    """The frame of one fused call on the NCCL transport, the same for every op:

        with fused_call(rt, err, cfg.check, (cs, ns), (name, counters, flags), ...) as (cur, words):
            ...allocate the outputs, queue the grids on cur and the collectives on the side streams...

    On entry, under the device's order lock: ``cur`` (the caller's stream) ordered after the
    previous call (``DeviceOrder``); each ``(name, counters, flags)`` of the call's local
    words (``Runtime.local_words``) zeroed on ``cur``; the side streams forked from ``cur``
    after that, so every launch and flag post comes after the zeroing. On exit, an
    exception too: the side streams joined back into ``cur`` (their work is ordered
    before the next call's zeroing) and the order released. Then, without an exception,
    the error word reported as ``check`` says, still under the lock (a cleared report's
    zeroing is queued on ``cur``, which the next call is ordered after)."""

    __slots__ = ("rt", "err", "check", "side", "specs", "cur")

    def __init__(self, rt: "Runtime", err: _flags.ErrorWord, check: str, side: tuple, *specs: tuple) -> None:
        self.rt, self.err, self.check, self.side, self.specs = rt, err, check, side, specs

    def __enter__(self) -> tuple[Any, list[Any]]:
        rt = self.rt
        rt.order.lock.acquire()
        try:
            words = [rt.local_words(*spec) for spec in self.specs]
            self.cur = cur = rt.current_stream()
            rt.order.begin(cur)
        except BaseException:
            rt.order.lock.release()
            raise
        try:
            for w in words:
                _flags.stream_zero(cur, w.buf, w.buf.numel())
            rt.fork(cur, *self.side)
        except BaseException:
            rt.order.end(cur)
            rt.order.lock.release()
            raise
        return cur, words

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        rt = self.rt
        try:
            try:
                rt.join(self.cur, *self.side)
            finally:
                rt.order.end(self.cur)
            if exc_type is None:
                report_errors(self.err, self.check)
        finally:
            rt.order.lock.release()


def report_errors(err: _flags.ErrorWord, check: str) -> None:
    """Turn a recorded flag timeout into ``FlagTimeoutError`` as ``check`` says. Inside a
    graph capture nothing (a capture may not synchronize or read the host mirror on
    every replay): replays' timeouts surface on the next eager call or ``check_errors``."""
    if capturing():
        return
    report_eager(err, check)


def report_eager(err: _flags.ErrorWord, check: str) -> None:
    """``report_errors`` outside a capture (a call plan's body, which never runs in one)."""
    try:
        if check == "sync":
            err.check(block=True)
        elif check == "async":
            err.check_async()
    except _flags.FlagTimeoutError as e:
        from .. import observe

        observe.record_timeout(err.what.split(" ", 1)[0], (), e)
        raise


def wait_count(stream: Any, flags: torch.Tensor, idx: int, count: int, err: Any, rank: int, timeout_ns: int) -> None:
    """Hold ``stream``'s next work until ``flags[idx] >= count`` (a producer grid's tiles of
    a chunk, each counted once stored). Eagerly one ``cuStreamWaitValue32`` (no SM); while
    a graph is captured a gate (``kernels.gate``: one program, one warp, its wait bounded
    by ``timeout_ns`` and a timeout recorded in ``err``), because a kernel node costs the
    graph's launch less host time than a stream memory operation (``kernels.post``). The
    producer grid never waits, and leaves the SMs of the NCCL CTAs free, so the gate
    holds up no tile of it."""
    if count <= 0:
        return  # (no tile of this chunk: nothing to wait for)
    if _flags.kernel_form(flags):
        from ..kernels import gate as _gate

        with torch.cuda.stream(stream):
            _gate.launch_gate(flags, idx, count, 3 * count, err.word, rank=rank, timeout_ns=timeout_ns)
        return
    _flags.stream_wait_value(stream, flags, idx, count)
