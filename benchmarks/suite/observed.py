"""``--profile``: what ``overlap.report()`` says about each variant of a case.

After a case is timed (with profiling off: the suite's own figures are not perturbed),
the runner turns profiling on and calls every variant that ran (external ones aside) a few
more times, in the case's order, so that the serial baselines (the references, the chain's
stream-sync) come before the overlapped paths whose hidden fraction needs their
alone-times. Per variant it records the path the report saw those calls take (why, how
many) and that path's CUDA-event figures: ``op_ms``, the in-call ``comm_ms`` / ``gemm_ms``,
``comm_alone_ms`` / ``gemm_alone_ms`` and ``hidden`` (None where the report has none: on
a CPU, or a variant whose calls the library does not time). The report counts calls and
times them with events that it reads without waiting; the runner synchronizes before
reading, outside any timed loop.
"""

from __future__ import annotations

from typing import Any

from .spec import Case

__all__ = ["FIELDS", "observe_case", "empty"]

FIELDS = ("path", "why", "calls", "serial", "op_ms", "comm_ms", "gemm_ms", "comm_alone_ms", "gemm_alone_ms",
          "hidden")


def empty() -> dict[str, Any]:
    """A variant's record with every key and nothing seen."""
    return {f: None for f in FIELDS}


def _snapshot(rows: list[dict], op: str) -> tuple[dict, dict]:
    """({(path, why): calls}, {(path, serial): timing entry}) of ``op``'s rows (all shapes)."""
    calls: dict[tuple, int] = {}
    timing: dict[tuple, dict] = {}
    for r in rows:
        if r["op"] != op:
            continue
        for p in r["paths"]:
            calls[(p["path"], p["why"])] = calls.get((p["path"], p["why"]), 0) + p["calls"]
        for t in r["timing"]:
            timing[(t["path"], t["serial"])] = t
    return calls, timing


def _seen(before: tuple[dict, dict], after: tuple[dict, dict]) -> dict[str, Any]:
    """The path a variant's calls took (most calls counted, else most calls timed) and its figures."""
    (c0, t0), (c1, t1) = before, after
    counted = {k: n - c0.get(k, 0) for k, n in c1.items() if n > c0.get(k, 0)}
    timed = {k: t["calls"] - (t0[k]["calls"] if k in t0 else 0) for k, t in t1.items()
             if t["calls"] > (t0[k]["calls"] if k in t0 else 0)}
    out = empty()
    if counted:
        (path, why), n = max(counted.items(), key=lambda kv: kv[1])
        out.update(path=path, why=why, calls=n)
        key = (path, False) if (path, False) in t1 else (path, True) if (path, True) in t1 else None
    elif timed:
        key = max(timed.items(), key=lambda kv: kv[1])[0]
        out.update(path=key[0], calls=timed[key])
    else:
        return out
    if key is not None:
        t = t1[key]
        out["serial"] = key[1]
        for f in FIELDS[4:]:
            out[f] = t.get(f)
    return out


def observe_case(case: Case, op: str, calls: int, skip: set[str], sync: Any = None) -> tuple[dict, list[dict]]:
    """Profile ``calls`` calls of each variant of ``case`` (not external, not n/a, not in
    ``skip``) and read ``overlap.report()`` for ``op`` (its name there, e.g.
    "all_gather_matmul"): ({variant: record}, the report's rows of ``op``). Every rank
    calls the same variants in the same order (collectives)."""
    from overlap import observe

    was = observe.profile()
    out: dict[str, dict] = {}
    try:
        observe.profile(True)
        before = _snapshot(observe.report().rows, op)
        for name, v in case.variants.items():
            if v.fn is None or v.role == "external" or name in skip:
                continue
            for _ in range(calls):
                v.fn()
            if sync is not None:
                sync()  # the events are read once complete; here they are
            after = _snapshot(observe.report().rows, op)
            out[name] = _seen(before, after)
            before = after
    finally:
        observe.profile(was)
    rows = [r for r in observe.report().rows if r["op"] == op]
    return out, rows
