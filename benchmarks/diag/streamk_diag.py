"""The stream-K GEMM (``GemmConfig.stream_k``) against cuBLAS and a sweep's picks, on the
sweep's slowest shapes (one GPU).

    python benchmarks/diag/streamk_diag.py --sweep benchmarks/results/<dir>/gemm_sweep.json [--below 0.96]
                                            [--out DIR] [--rounds 7]

Per shape (the sweep's rows under ``--below`` x cuBLAS): cuBLAS (``torch.mm``), the sweep's
picked config, and in stream-K order the pick's tile (3 and 4 stages where they fit) and
128x128 at 4 and 5 stages; each checked against cuBLAS, then timed as CUDA-graph replays
in interleaved rounds (medians). Writes ``streamk_diag.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", required=True)
    ap.add_argument("--below", type=float, default=0.96)
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import torch

    from benchmarks.context import run_context
    from overlap.kernels.autotune import GraphTimer, _cfg_str, rejects
    from overlap.kernels.tile_gemm import GemmConfig, launch_tile_gemm
    from overlap.policies import Segment, build_tile_table

    rows = [r for r in json.load(open(args.sweep))["rows"]
            if r.get("tile_ms") and r["cublas_ms"] / r["tile_ms"] < args.below]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dev = torch.device("cuda")
    out = []
    for r in sorted(rows, key=lambda r: r["cublas_ms"] / r["tile_ms"]):
        m, n, k, b_kn = r["m"], r["n"], r["k"], r["b_layout"] == "kn"
        dtype = getattr(torch, r["dtype"])
        pick = GemmConfig(**r["config_fields"])
        base = GemmConfig(block_m=pick.block_m, block_n=pick.block_n, block_k=64, num_warps=pick.num_warps,
                          group_m=pick.group_m, stream_k=True)
        cands = {"pick": pick}
        for bm, bn, nw, stages in ((pick.block_m, pick.block_n, pick.num_warps, (3, 4)), (128, 128, 4, (4, 5)),
                                   (128, 256, 8, (3, 4))):
            for st in stages:
                cfg = GemmConfig(block_m=bm, block_n=bn, block_k=64, num_stages=st, num_warps=nw,
                                 group_m=base.group_m, stream_k=True)
                if rejects(cfg) is None and bm <= max(m, 64):
                    cands.setdefault(_cfg_str(cfg), cfg)
        g = torch.Generator(device=dev).manual_seed(m + n + k)
        a = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
        w = torch.randn(n, k, device=dev, dtype=dtype, generator=g) / k ** 0.5
        b = w.t().contiguous() if b_kn else w.t()
        ref = torch.mm(a, b)
        timers = {"cublas": GraphTimer(lambda: torch.mm(a, b, out=ref))}
        errs = {}
        for name, cfg in cands.items():
            table = torch.tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, cfg.block_m,
                                                  cfg.block_n, group_m=cfg.group_m), dtype=torch.int32, device=dev)
            c = torch.full((m, n), float("nan"), device=dev, dtype=dtype)
            try:
                launch_tile_gemm(a, b, c, table, grid=sms, config=cfg)
                torch.cuda.synchronize()
                errs[name] = ((c.float() - ref.float()).norm() / ref.float().norm()).item()
                timers[name] = GraphTimer(lambda c=c, table=table, cfg=cfg: launch_tile_gemm(a, b, c, table, grid=sms,
                                                                                             config=cfg))
            except Exception as e:  # noqa: BLE001 - reported
                errs[name] = f"{type(e).__name__}: {str(e)[:160]}"
        times = {kk: [] for kk in timers}
        for _ in range(args.rounds):
            for kk, t in timers.items():
                times[kk].append(t.ms())
        med = {kk: statistics.median(v) for kk, v in times.items()}
        res = {"m": m, "n": n, "k": k, "b_layout": r["b_layout"], "dtype": r["dtype"], "sweep_ratio":
               round(r["cublas_ms"] / r["tile_ms"], 4), "pick": _cfg_str(pick), "ms": med, "rel_err": errs,
               "speed_vs_cublas": {kk: round(med["cublas"] / v, 4) for kk, v in med.items() if kk != "cublas"}}
        out.append(res)
        best = max(res["speed_vs_cublas"].items(), key=lambda kv: kv[1])
        print(f"{m}x{n}x{k} {r['b_layout']} {r['dtype']}: cublas {med['cublas']:.4f} pick "
              f"{res['speed_vs_cublas'].get('pick')} best {best}", flush=True)
        for kk, v in res["speed_vs_cublas"].items():
            print(f"    {kk:40s} {v:.3f}  err {errs.get(kk)}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "streamk_diag.json"), "w") as f:
        json.dump({"context": run_context(), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
