"""Diagnose GluonGemmConfig.split_tail on a GPU: which tiles are wrong, which K slices their
values hold (least squares over the slices' partials), and whether the workspace holds each
slice's partial."""
import sys

import torch

sys.path.insert(0, ".")
from overlap.kernels.gluon_gemm import GluonGemmConfig, GluonGemmPlan  # noqa: E402
from overlap.policies import Segment, build_tile_table  # noqa: E402


def run(cfg, m, n, k, grid):
    bm, bn = cfg.block_m, cfg.block_n
    t = torch.tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, bm, bn), dtype=torch.int32,
                     device="cuda")
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
    c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    p = GluonGemmPlan(a, b, c, t, config=cfg)
    p.launch(a, b, c, epoch=0, grid=grid)
    torch.cuda.synchronize()
    sp = p.split[1]
    ref = a.float() @ b.float()
    err = (c.float() - ref).abs().nan_to_num(1e9)
    print(f"{bm}x{bn} {m}x{n}x{k} grid {grid} plan {sp} max err {err.max().item():.3f}", flush=True)
    if sp is None:
        return
    start, q, r, units = sp
    kt = -(-k // cfg.block_k)
    ws = p.split[2].view(units - start, bm, bn)
    for i in range(t.shape[0] - start):
        row = t[start + i].tolist()
        c_row, c_rows, n_tile = row[2], row[3], row[4] & 0xFFFF
        nn = q + 1 if i < r else q
        base = i * (q + 1) if i < r else r * (q + 1) + (i - r) * q
        cols = slice(n_tile * bn, min(n, (n_tile + 1) * bn))
        rows = slice(c_row, c_row + c_rows)
        parts = []
        for s in range(nn):
            k0, k1 = s * kt // nn * cfg.block_k, min(k, (s + 1) * kt // nn * cfg.block_k)
            parts.append(a[rows, k0:k1].float() @ b[k0:k1, cols].float())
        got = c[rows, cols].float()
        A = torch.stack([pp.flatten() for pp in parts], 1)
        coef = torch.linalg.lstsq(A, got.flatten().nan_to_num(0).unsqueeze(1)).solution.flatten()
        wsok = []
        for s in range(nn):
            w = ws[base + s, :c_rows, :cols.stop - cols.start]
            wsok.append(round((w - parts[s]).abs().max().item(), 3))
        print(f"   tail {i} tile row {c_row} ntile {n_tile} slices {nn}: err {(got - ref[rows, cols]).abs().max().item():.3f}"
              f" coef {[round(x, 2) for x in coef.tolist()]} ws-vs-partial {wsok}", flush=True)


if __name__ == "__main__":
    for bm, bn in ((128, 256),):
        cfg = GluonGemmConfig(block_m=bm, block_n=bn, stages=3, split_tail=True)
        for m, n, k in ((1000, 1000, 1000), (1024, 1024, 1024), (1000, 1024, 1024), (1024, 1000, 1024),
                        (1024, 1024, 1000), (2048, 2048, 1024)):
            run(cfg, m, n, k, 30)
        run(cfg, 2048, 2048, 1024, 124)
        run(cfg, 2048, 1536, 4096, 132)
