"""Timers: CUDA events on GPUs, time.perf_counter on CPU; median; slowest rank.

Every figure is milliseconds per call, and the slowest rank's: each rank takes its
median, then an ``all_reduce(MAX)`` over the group. Every rank must time the same
callables in the same order (the timers hold barriers and a reduction).

GPU, pipelined (default): after ``warmup`` calls, ``reps`` batches of ``iters`` calls back
to back between two CUDA events (the host runs ahead, as in a training step); the median
of the batches' per-call means. ``time_interleaved`` times several callables this way in
rounds (one batch of each per round), so that slow drifts of the GPU's clocks and
temperature over a case touch every variant alike. GPU, synced: every call alone between a barrier and a
synchronize (host launch latency shows); the median over ``iters`` calls.

CPU (gloo): every call alone between a barrier and its return, timed with
``time.perf_counter``; the median over ``iters`` calls. Not GPU figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist


def slowest(value: float, group: Any, device: torch.device) -> float:
    """The largest ``value`` over the group's ranks."""
    t = torch.tensor([value], dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=group)
    return float(t.item())


def any_rank(flag: bool, group: Any, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on some rank (ranks agree on skipping)."""
    return slowest(1.0 if flag else 0.0, group, device) > 0.5


class Timer:
    def __init__(self, *, group: Any, device: torch.device, iters: int, warmup: int, reps: int = 5) -> None:
        if iters < 1 or warmup < 0 or reps < 1:
            raise ValueError(f"iters >= 1, warmup >= 0, reps >= 1; got {iters}, {warmup}, {reps}")
        self.group, self.device, self.iters, self.warmup, self.reps = group, device, iters, warmup, reps
        self.cuda = device.type == "cuda"
        self._barrier_kw = ({"device_ids": [device.index]}
                            if self.cuda and tdist.get_backend(group) == "nccl" and device.index is not None else {})
        self.method = ("CUDA events, median of per-call means over batches of calls back to back"
                       if self.cuda else "time.perf_counter per call, CPU")

    def _barrier(self) -> None:
        tdist.barrier(group=self.group, **self._barrier_kw)

    def time(self, fn: Callable[[], Any], *, synced: bool = False) -> float:
        """Milliseconds per call of ``fn``, median, slowest rank."""
        for _ in range(self.warmup):
            fn()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            ms = self._cuda_synced(fn) if synced else self._cuda_pipelined(fn)
        else:
            ms = self._cpu(fn)
        return slowest(ms, self.group, self.device)

    def _batch(self, fn: Callable[[], Any]) -> float:
        self._barrier()
        torch.cuda.synchronize(self.device)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(self.iters):
            fn()
        e.record()
        torch.cuda.synchronize(self.device)
        return s.elapsed_time(e) / self.iters

    def _cuda_pipelined(self, fn: Callable[[], Any]) -> float:
        return statistics.median(self._batch(fn) for _ in range(self.reps))

    def time_interleaved(self, fns: dict[str, Callable[[], Any]],
                         on_error: Callable[[str, BaseException | None], None]) -> dict[str, float]:
        """GPU, pipelined: every callable warmed up, then ``reps`` rounds of one batch of
        each; per callable the median batch, slowest rank. A callable that raises (on any
        rank) is reported through ``on_error(name, exc or None)`` and dropped."""
        live: dict[str, Callable[[], Any]] = {}
        for name, fn in fns.items():
            err: BaseException | None = None
            try:
                for _ in range(max(1, self.warmup)):
                    fn()
                torch.cuda.synchronize(self.device)
            except Exception as e:  # noqa: BLE001  (reported, not fatal)
                err = e
            if any_rank(err is not None, self.group, self.device):
                on_error(name, err)
            else:
                live[name] = fn
        times: dict[str, list[float]] = {n: [] for n in live}
        for _ in range(self.reps):
            for name in list(live):
                err = None
                try:
                    times[name].append(self._batch(live[name]))
                except Exception as e:  # noqa: BLE001
                    err = e
                if any_rank(err is not None, self.group, self.device):
                    on_error(name, err)
                    del live[name], times[name]
        return {n: slowest(statistics.median(t), self.group, self.device) for n, t in times.items()}

    def _cuda_synced(self, fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(self.iters):
            self._barrier()
            torch.cuda.synchronize(self.device)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize(self.device)
            times.append(s.elapsed_time(e))
        return statistics.median(times)

    def _cpu(self, fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(self.iters):
            self._barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
