"""Which of the Gluon GEMM's parts (tiles that post, C from registers, the 192-column tile,
the test of posts per variant) runs to the end on this GPU, each case alone in a process of
its own under a time bound, so a kernel that never ends names itself instead of stopping
the run:

    python benchmarks/diag/gluon_post_diag.py [--cases post_static,regs,...] [--bound 40]

Each case launches the kernel on fresh inputs (C poisoned with NaN) and checks C against
torch and every post flag against its tile count; it prints ``CASE name: ok ...``, the
assertion that failed, or ``CASE name: HUNG at <stage>`` with the Python stack where its
process outlived the bound. ``reader_steps`` (asked for by name only): work queued beside
and behind a stream wait whose flag is not yet set, one step at a time. Then, with
``--ptx``, the posting kernel's build here: its barriers and atomics in PTX order.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

CASES = ("plain", "post_static", "post_dyn", "post_two", "post_cut", "regs", "regs_post", "wide", "wide_dyn",
         # check_posts (the test of posts) on one variant, each stage named as it starts
         "check_posts_128x256", "check_posts_256x128", "check_posts_128x128", "check_posts_128x256r4",
         # a reader stream's wait (cuStreamWaitValue32) queued before anything sets its flag, then
         # work queued beside it and behind it, one step at a time (not run by default: under
         # CUDA's lazy loading a kernel's first launch behind the wait blocks for good)
         "reader_steps")
DEFAULT_CASES = tuple(c for c in CASES if c != "reader_steps")


def _reader_steps(name: str) -> str:
    import torch

    from overlap import flags as _flags

    def at(stage: str) -> None:
        print(f"CASE {name}: at {stage}", flush=True)

    flags = torch.zeros(4, dtype=torch.int32, device="cuda")
    c = torch.randn(1000, 1000, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(c)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    at("a wait queued on the side stream")
    _flags.stream_wait_value(side, flags, 0, 1)
    at("a second wait queued on it")
    _flags.stream_wait_value(side, flags, 1, 1)
    at("a device-to-device copy queued behind the waits")
    with torch.cuda.stream(side):
        out.copy_(c)
    at("a kernel's first launch, on the current stream (not the waiting one)")
    c.add_(1)
    at("a kernel's first launch, queued behind the waits")
    with torch.cuda.stream(side):
        out.mul_(2)
    at("a fresh tensor on the current stream")
    d = torch.zeros(7, 9, device="cuda")
    at("the flags set from the current stream")
    flags.fill_(1)
    at("the device synchronized")
    torch.cuda.synchronize()
    # the side stream's copy ran once its waits were released: after c += 1 (doubling is exact)
    assert torch.equal(out, c * 2), "the side stream's copy did not wait for its flags"
    assert int(d.abs().sum()) == 0
    return "every step queued and ended, the side stream's work after its flags"


def _run_case(name: str) -> str:
    import torch

    from benchmarks.gluon_gemm_bench import VARIANTS, _b, _close, _table, check_posts
    from overlap import protocol as P
    from overlap.kernels.gluon_gemm import GluonGemmConfig, launch_gluon_gemm
    from overlap.policies import Segment

    if name == "reader_steps":
        return _reader_steps(name)
    if name.startswith("check_posts_"):
        log: list[str] = []
        v = name[len("check_posts_"):]
        check_posts(log, {v: VARIANTS[v]}, trace=lambda stage: print(f"CASE {name}: at {stage}", flush=True))
        return log[-1]
    variant = {"regs": "128x256r4", "regs_post": "128x256r4", "wide": "128x192", "wide_dyn": "128x192"}
    cfg = GluonGemmConfig(**VARIANTS[variant.get(name, "128x256")])
    post = name.startswith("post") or name.endswith("_post")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m, n, k = 1000, 1000, 768
    bounds = [0, 256, 512, 768, m]
    segs = [Segment(a_src=0, a_row=lo, c_row=lo, rows=hi - lo, post_base=16 * i if post else -1)
            for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
    rows = None
    if name == "post_cut":
        m, segs, rows = 300, [Segment(a_src=0, a_row=0, c_row=0, rows=512, post_base=0)], (300, 512)
    table = _table(segs, n, cfg.block_m, cfg.block_n)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = _b(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5, "nk")
    c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    flags = torch.zeros(64, dtype=torch.int32, device="cuda")
    kw: dict[str, Any] = dict(config=cfg, post=post, rows=rows)
    if post:
        kw["flags"] = flags
    dyn = name in ("post_dyn", "post_two", "wide_dyn")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda") if dyn else None
    give = torch.cuda.Stream()
    give.wait_stream(torch.cuda.current_stream())  # (before the first grid: the two run at once)
    launch_gluon_gemm(a, b, c, table, grid=max(1, sms // 2) if name == "post_two" else sms, counter=counter, **kw)
    if name == "post_two":
        with torch.cuda.stream(give):
            launch_gluon_gemm(a, b, c, table, grid=8, counter=counter, **kw)
        torch.cuda.current_stream().wait_stream(give)
    print(f"CASE {name}: launched", flush=True)  # (built and queued: a bound passed after this is a hang)
    torch.cuda.synchronize()
    err = _close(c, a, b, slice(None), name)
    said = f"max error {err:.2e}"
    if post:
        posts = table[:, P.COL_POST].long()
        want = torch.bincount(posts[posts >= 0], minlength=64).cpu()
        got = flags.long().cpu()
        assert torch.equal(got, want), f"{name}: flags {got.tolist()} want {want.tolist()}"
        said += f", {int(want.sum())} posts counted"
    return said


def _ptx() -> None:
    from tests.kernels.test_gluon_gemm import sm90

    for what, kw in (("posting kernel", dict(has_wait=False, post=True, dynamic=True, clip=True)),
                     ("plain kernel", dict(has_wait=False, dynamic=True, clip=True))):
        ptx = sm90(**kw).asm["ptx"]
        lines = [(i, ln.strip()) for i, ln in enumerate(ptx.splitlines())
                 if re.search(r"\b(bar|barrier)\.|\bred\.|\batom\.|mbarrier\.arrive\b", ln)]
        print(f"PTX {what}: {len(lines)} barrier / atomic lines")
        for i, ln in lines:
            print(f"  {i:6d}  {ln}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"of {', '.join(CASES)}")
    ap.add_argument("--bound", type=float, default=40.0, help="seconds a case's process may take")
    ap.add_argument("--ptx", action="store_true")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # (one case, in its own process)
    args = ap.parse_args()
    if args.case:
        import faulthandler

        faulthandler.dump_traceback_later(max(1.0, args.bound - 5), exit=True)  # (a hang's Python stack)
        print(f"CASE {args.case}: ok, {_run_case(args.case)}", flush=True)
        return
    for name in args.cases.split(","):
        if name not in CASES:
            sys.exit(f"unknown case {name!r}; cases: {', '.join(CASES)}")
        try:  # (the case's process dumps its Python stack and exits 5 s before its bound)
            r = subprocess.run([sys.executable, __file__, "--case", name, "--bound", str(args.bound)],
                               capture_output=True, text=True, timeout=args.bound + 10)
            out, err, stack = r.stdout, r.stderr, "Timeout (" in r.stderr
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, stack = "", True
        ok = [ln for ln in out.splitlines() if ln.startswith(f"CASE {name}: ok")]
        if ok:
            print(ok[-1], flush=True)
        elif stack:
            at = [ln.split(": at ", 1)[1] for ln in out.splitlines() if ": at " in ln]
            when = (f"at {at[-1]}" if at else "after its launch" if "launched" in out
                    else "before its launch (a slow build?)")
            print(f"CASE {name}: HUNG {when} (no end in {args.bound:.0f} s)", flush=True)
            for ln in [ln for ln in err.splitlines() if ln.strip().startswith("File ")][:6]:
                print(f"    {ln.strip()}", flush=True)  # (innermost first)
        else:
            print(f"CASE {name}: rc={r.returncode} {err.strip()[-600:]}", flush=True)
    if args.ptx:
        _ptx()


if __name__ == "__main__":
    main()
