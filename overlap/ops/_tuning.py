"""The tuners' skeleton: timing candidates collectively, dropping those that time out on any
rank, the variant passes (split tail, flattened GEMM, warp specialization) and the
confirmation rounds against the sequential path (``tune_paths``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import flags as _flags
from .. import observe as _observe
from ..dist import shared as _share
from ._config import SEQUENTIAL, Chunked, OverlapConfig, Path
from ._state import warn_once

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = ["time_ms", "tuning_bound", "time_candidates", "split_variants", "flat_variants", "ws_variants",
           "confirm_best", "shared_gpu_choices", "tune_paths", "WARM_TIMEOUT_MS", "TUNE_TIMEOUT_MS"]


def time_ms(fn: Any, iters: int, group: Any, batches: int = 3) -> float:
    """Milliseconds per call of ``fn`` (calls back to back; the median of ``batches``
    batches of ``iters`` calls), slowest rank; collective."""
    import statistics

    import torch.distributed as tdist

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        tdist.barrier(group=group)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    t = torch.tensor([statistics.median(times)], device="cuda")
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=group)
    return float(t.item())


def _none_timed_out(rt: Runtime, err: _flags.ErrorWord, group: Any, key: str, message: Any) -> bool:
    """Collective: True on every rank when no rank's ``err`` recorded a timeout; else
    False everywhere, and the ranks that saw one warn once (``message(error)``)."""
    import torch.distributed as tdist

    failed = torch.zeros(1, device=rt.device)
    try:
        err.check(block=True)
    except _flags.FlagTimeoutError as e:
        failed += 1
        warn_once(key, message(e))
    tdist.all_reduce(failed, group=group)
    return failed.item() == 0


WARM_TIMEOUT_MS = 60_000.0
"""Wait bound of a tuner candidate's first (compiling) call: a bound, not a hang."""
TUNE_TIMEOUT_MS = 5_000.0
"""Wait bound of a tuner's timed calls of a candidate that sets none. The ranks start
each candidate together (a barrier after its warm call), so a wait this long means the
candidate starves its own communication (e.g. NCCL finds no SM): it is dropped within
seconds, not after the minutes of the default bound (``flags.default_timeout_ms``)."""


def tuning_bound(cand: "OverlapConfig", shared: bool = False) -> "OverlapConfig":
    """``cand`` with its timed calls' wait bound: its own, else ``TUNE_TIMEOUT_MS`` (in
    shared-GPU mode at least ``overlap.dist.shared.SHARED_WAIT_FLOOR_MS``: a peer's
    pushes may wait whole time slices behind this rank's kernels)."""
    from dataclasses import replace

    if cand.timeout_ms is not None:
        return cand
    return replace(cand, timeout_ms=_share.library_wait_ms(TUNE_TIMEOUT_MS, shared))


def time_candidates(rt: Runtime, err: _flags.ErrorWord, candidates: list[OverlapConfig], run: Any, iters: int,
                    group: Any, describe: Any = None, timer: Any = None) -> list[tuple[float, OverlapConfig]]:
    """The tuners' common loop (collective): time ``run(cand)`` for each candidate with
    error checks off, then drop the candidate on every rank if its waits timed out on
    any rank. Returns ``[(ms, cand with check="async")]`` for the survivors.
    ``describe(cand)``: a label to print on rank 0 (None: quiet); ``timer``: ``time_ms``.

    Each candidate is first called once with its waits bounded by ``WARM_TIMEOUT_MS``,
    and no rank goes on before every rank is done: that call compiles the candidate's
    kernels, and a rank still compiling queues its next call late, past the bound of
    a peer that went on (a suite run at 9ad0b16 lost a candidate that way)."""
    import torch.distributed as tdist
    from dataclasses import replace

    timer = timer or time_ms
    out: list[tuple[float, OverlapConfig]] = []
    for cand in candidates:
        cand = replace(cand, check="none")
        run(replace(cand, timeout_ms=max(cand.timeout_ms or 0.0, WARM_TIMEOUT_MS)))
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        tdist.barrier(group=group)
        timed = tuning_bound(cand, getattr(rt, "shared_gpu", False))
        t = timer(lambda: run(timed), iters, group)
        ok = _none_timed_out(rt, err, group, f"tune-timeout-{err.what}-{cand}",
                             lambda e, cand=cand: f"tuner: {cand} timed out ({e}); skipped")
        if ok:
            out.append((t, replace(cand, check="async")))
        if describe is not None and rt.rank == 0:
            print(f"{describe(cand)}: {t:.3f} ms" + ("" if ok else " (timed out: rejected)"), flush=True)
    return out


def split_variants(results: list[tuple[float, Any]], top: int = 2, parts: tuple[int, ...] = (2, 8)) -> list[Any]:
    """The ``top`` fastest configs of a tuner's first pass (``(ms, choice)`` pairs; paths
    named by strings are skipped) again with their GEMM's tail split into at most each
    of ``parts`` K pieces (``OverlapConfig.split_tail``), for a second pass."""
    from dataclasses import replace

    ranked = [c for _, c in sorted(results, key=lambda r: r[0]) if isinstance(c, OverlapConfig) and c.split_tail < 2
              and not getattr(c.gemm, "flatten", False)]  # a flattened GEMM takes no split tail
    return [replace(c, split_tail=s) for c in ranked[:top] for s in parts]


def flat_variants(results: list[tuple[float, Any]], top: int = 2) -> list[Any]:
    """The ``top`` fastest configs of a tuner's passes so far (``(ms, choice)`` pairs; paths
    that are not configs are skipped) again with their GEMM flattened
    (``GemmConfig.flatten``: one software pipeline over a program's tiles), for ops whose
    GEMM tiles wait on nothing (the producer ops). Configs with split tiles or a
    warp-specialized GEMM are left out (the flattened kernel takes neither)."""
    from dataclasses import replace

    from ..kernels.tile_gemm import DEFAULT_CONFIG

    ranked = [c for _, c in sorted(results, key=lambda r: r[0]) if isinstance(c, OverlapConfig)
              and c.split_tail < 2 and not (c.gemm is not None and (c.gemm.flatten or c.gemm.warp_specialize))]
    return [replace(c, gemm=replace(c.gemm or DEFAULT_CONFIG, flatten=True), give_back=False) for c in ranked[:top]]


def ws_variants(results: list[tuple[float, Any]], device: Any, top: int = 2) -> list[Any]:
    """The ``top`` fastest configs of a tuner's passes so far (``(ms, choice)`` pairs; paths
    named by strings are skipped) again with their GEMM's K loop warp-specialized
    (``GemmConfig.warp_specialize``), for another pass; none where this Triton and the
    GPU ``device`` cannot build it (``warp_specialize_supported``). Configs with the reduce kernel beside
    the GEMM (``reduce_shared``) are left out: its programs are sized to fit beside the
    plain GEMM's."""
    from dataclasses import replace

    from ..kernels.tile_gemm import DEFAULT_CONFIG, warp_specialize_supported

    if not warp_specialize_supported(device):
        return []
    ranked = [c for _, c in sorted(results, key=lambda r: r[0])
              if isinstance(c, OverlapConfig) and not c.reduce_shared
              and not getattr(c.gemm, "warp_specialize", False) and not getattr(c.gemm, "flatten", False)]
    return [replace(c, gemm=replace(c.gemm or DEFAULT_CONFIG, warp_specialize=True)) for c in ranked[:top]]


def confirm_best(rt: Runtime, err: _flags.ErrorWord, results: list[tuple[float, Any]], fn_for: Any, iters: int,
                 group: Any, top: int = 3, rounds: int = 3, describe: Any = None,
                 timer: Any = None, keep: tuple[Any, ...] = ()) -> tuple[float, Any]:
    """The tuners' last step (collective): the ``top`` fastest of ``results`` ((ms,
    choice) pairs, each timed once, one after another) timed again in ``rounds``
    rounds of one batch each, interleaved, so that a drift of the GPU's clocks during
    the first pass cannot pick the winner; returns (median ms, choice) of the fastest.
    ``fn_for(choice)``: the callable to time, with error checks off. Times are the
    slowest rank's (``time_ms``), so every rank picks the same. If a tile-flag
    choice's waits time out here on any rank, the first pass's fastest is returned.
    ``describe(choice)``: a label to print on rank 0 (None: quiet). ``keep``: choices
    (e.g. the sequential baseline) timed again too wherever the first pass ranked them:
    a drift during the first pass then cannot pick a config slower than them."""
    import statistics

    timer = timer or time_ms
    ordered = sorted(results, key=lambda r: r[0])
    ranked = ordered[:max(1, top)]
    ranked += [r for r in ordered[max(1, top):] if not isinstance(r[1], OverlapConfig) and r[1] in keep]
    if len(ranked) < 2 or rounds < 1:
        return ranked[0]
    times: list[list[float]] = [[] for _ in ranked]
    for _ in range(rounds):
        for i, (_, choice) in enumerate(ranked):
            times[i].append(timer(fn_for(choice), iters, group, batches=1))
    if not _none_timed_out(rt, err, group, f"tune-confirm-timeout-{err.what}",
                           lambda e: f"tuner: a finalist timed out ({e}); keeping the first pass"):
        return ranked[0]
    meds = [statistics.median(t) for t in times]
    best = min(range(len(ranked)), key=lambda i: meds[i])
    if describe is not None and rt.rank == 0:
        for (t0, choice), med in zip(ranked, meds):
            print(f"{describe(choice)}: {t0:.3f} ms, again {med:.3f} ms{'  <- picked' if med == meds[best] else ''}",
                  flush=True)
    return meds[best], ranked[best][1]


def shared_gpu_choices(rt: Any, op: str, candidates: list[OverlapConfig], baselines: dict[Chunked, Any] | None
                       ) -> tuple[list[OverlapConfig], dict[Chunked, Any] | None]:
    """A tuner's candidates and baselines that can run on ``rt``: in shared-GPU mode
    (``overlap.dist.shared``) neither the NCCL candidates nor the chunked baselines (NCCL
    calls) can, and they are left out, with a warning where the caller named any."""
    if not (getattr(rt, "shared_gpu", False) and rt.world > 1):
        return candidates, baselines
    keep = [c for c in candidates if not (isinstance(c, OverlapConfig) and c.transport == "nccl")]
    if len(keep) < len(candidates) or baselines:
        warn_once(f"shared-gpu-tune-{op}", f"{op}: tuner: shared-GPU mode: {len(candidates) - len(keep)} NCCL "
                  f"candidate(s) and {len(baselines or {})} chunked baseline(s) (NCCL) left out; NCCL refuses "
                  "ranks that share a GPU")
    return keep, None


def tune_paths(rt: Runtime, op: str, shape: tuple[int, ...], title: str, *, ref: Any, candidates: list[OverlapConfig],
               run: Any, describe: Any, iters: int, group: Any, verbose: bool, cache: Any, key: Any,
               baselines: dict[Chunked, Any] | None = None, passes: tuple[Any, ...] = ()) -> Path:
    """The tuners' skeleton (collective: every rank calls it with the same shapes).

    Times the reference ``ref`` (``SEQUENTIAL``) and the ``baselines`` (``{Chunked(n):
    callable}``), then ``candidates`` through ``run(config)`` (``time_candidates``: a
    candidate whose waits time out on any rank is dropped), then each of ``passes``
    (``results -> more candidates``, e.g. ``split_variants``); the fastest three and the
    reference again in interleaved rounds (``confirm_best``). The pick goes into
    ``cache[key]`` (the op reads it when called without a config), into the report
    (``overlap.report()``), and, when it is not a tile-flag config, into a one-time warning.
    ``describe(config)``: a config's label; ``title``: the shape's, e.g. ``"agmm 8192x..."``."""
    from dataclasses import replace

    err = rt.err(op)
    candidates, baselines = shared_gpu_choices(rt, op, candidates, baselines)
    paths: dict[Any, Any] = {SEQUENTIAL: ref, **(baselines or {})}

    def label(choice: Any) -> str:
        return describe(choice) if isinstance(choice, OverlapConfig) else f"  tune {title}: {choice}"

    shown = label if verbose else None
    results: list[tuple[float, Any]] = []
    for path, fn in paths.items():
        results.append((time_ms(fn, iters, group), path))
        if verbose and rt.rank == 0:
            print(f"{label(path)}: {results[-1][0]:.3f} ms", flush=True)
    t_seq = results[0][0]
    results += time_candidates(rt, err, candidates, run, iters, group, shown)
    for more in passes:
        results += time_candidates(rt, err, more(results), run, iters, group, shown)

    def fn_for(choice: Any) -> Any:
        if not isinstance(choice, OverlapConfig):
            return paths[choice]
        quiet = tuning_bound(replace(choice, check="none"), getattr(rt, "shared_gpu", False))
        return lambda: run(quiet)

    best_t, best = confirm_best(rt, err, results, fn_for, iters, group, describe=shown, keep=(SEQUENTIAL,))
    cache[key] = best
    _observe.record_tuning(op, shape, [(label(c).strip(), t) for t, c in sorted(results, key=lambda r: r[0])],
                           label(best).strip())
    if not isinstance(best, OverlapConfig):
        warn_once(f"tuned-{op}-{best}-{key}",
                  f"{op}: tile-flag overlap does not pay for {title.split(' ', 1)[-1]} ({best} {best_t:.3f} ms was "
                  f"fastest; sequential {t_seq:.3f} ms); running {best} for this shape")
    return best
