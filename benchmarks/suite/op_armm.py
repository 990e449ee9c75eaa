"""All-reduce -> GEMM: ``h = all_reduce(x_partial) [+ residual]; c = norm(h) @ b``
(overlap.ops.all_reduce_matmul).

Shapes M x N x K: x_partial [M, K] on every rank, b [K, N]; each shape runs plain and with
residual + LayerNorm (label suffix ``+ln``; ``--shape 8192x1024x8192+ln``). Variants:
sequential reference, chunked stream overlap x2 and x4, the library's op (tuned first on
CUDA: tile-flag, chunked or sequential, whichever was fastest); torch has no symmetric-memory all-reduce -> GEMM op (n/a). Parts: an all-reduce of
an [M, K] tensor alone (library communicator; torch's recorded beside it) and the cuBLAS
GEMM [M, K] x [K, N] alone.
"""

from __future__ import annotations

from typing import Any

import torch

from .oputil import (CPU_FALLBACK, describe_config, fast_path_counter, library_comm, p2p_push_alone,
                     raise_kernel_errors, tile_gemm_alone, torch_all_reduce)
from .spec import Case, Env, OpSpec, Shape, Variant, mnk

_BASE = {
    "gpt3-175b": [(8192, 24576, 12288), (8192, 18432, 12288)],
    "comm-heavy": [(16384, 2048, 8192), (8192, 1024, 8192)],
    "llama-70b": [(8192, 14336, 8192)],
}
SHAPES = {s: [mnk(s, *d, ln=ln) for d in dims for ln in (False, True)] for s, dims in _BASE.items()}


def _suffix(s: str) -> dict[str, Any]:
    if s.lower() in ("ln", "layernorm"):
        return {"ln": True}
    raise ValueError(f"op armm: unknown shape suffix +{s} (known: +ln, residual + LayerNorm)")


def setup(shape: Shape, env: Env) -> Case:
    from overlap.ops import all_reduce_matmul, all_reduce_matmul_chunked, all_reduce_matmul_ref

    m, n, k = shape.dims["M"], shape.dims["N"], shape.dims["K"]
    g = env.group
    x = env.randn(m, k, seed=1000 * env.rank + m + n + k, scale=env.world ** -0.5)
    b = env.randn(n, k, seed=7, scale=k ** -0.5).t()
    kw: dict[str, Any] = {"group": g, "residual": None, "norm": None}
    if shape.params.get("ln"):
        from overlap.ops import Norm

        kw["residual"] = env.randn(m, k, seed=13)
        kw["norm"] = Norm(kind="layernorm", weight=env.randn(k, seed=17, scale=0.1) + 1,
                          bias=env.randn(k, seed=19, scale=0.1), eps=1e-5)
    zeros = torch.zeros(m, k, device=env.device, dtype=env.dtype)  # sums of zeros stay zeros
    zeros_out = torch.zeros_like(zeros)
    y = env.randn(m, k, seed=11)
    tile = Variant("library (tuned)", fn=lambda: all_reduce_matmul(x, b, **kw), role="library", synced=True,
                   counter=fast_path_counter(all_reduce_matmul),
                   note=None if env.on_gpu else "CPU: no tile-flag path, runs the reference")
    if env.on_gpu:
        from overlap.ops import tune_all_reduce_matmul

        if env.tune:
            tile.prepare = lambda: describe_config(tune_all_reduce_matmul(x, b, verbose=env.verbose, **kw))
        comm = library_comm(env)
        parts = {"comm": lambda: comm.all_reduce(zeros, zeros_out), "gemm": lambda: torch.mm(y, b)}
    else:
        tile.counter = None
        parts = {"comm": torch_all_reduce(env, zeros), "gemm": lambda: torch.mm(y, b)}

    def check() -> dict[str, float]:
        x2 = torch.randn_like(x)
        c, h = all_reduce_matmul(x2, b, **kw)
        c_ref, h_ref = all_reduce_matmul_ref(x2, b, **kw)
        return {"rel_err": env.rel_err(c, c_ref), "rel_err_h": env.rel_err(h, h_ref)}

    cpu_note = None if env.on_gpu else CPU_FALLBACK
    variants = {
        "reference": Variant("sequential", fn=lambda: all_reduce_matmul_ref(x, b, **kw), role="reference",
                             synced=True),
        "chunked2": Variant("chunked x2", fn=lambda: all_reduce_matmul_chunked(x, b, chunks=2, **kw), note=cpu_note),
        "chunked4": Variant("chunked x4", fn=lambda: all_reduce_matmul_chunked(x, b, chunks=4, **kw), note=cpu_note),
        "tile_flag": tile,
        "symm_mem": Variant("symm_mem", role="external", na="torch has no symmetric-memory all-reduce -> GEMM op"),
    }
    return Case(variants=variants, parts=parts, flops=2.0 * m * n * k, comm_bytes=m * k * x.element_size(),
                extra={k: v for k, v in (("comm_torch", torch_all_reduce(env, zeros)),
                                         ("tile_gemm", tile_gemm_alone(env, y, b)),
                                         ("comm_p2p_push", p2p_push_alone(env, x))) if v is not None}
                if env.on_gpu else {},
                check=check, finish=lambda: raise_kernel_errors(env))


OP = OpSpec(name="armm", title="All-reduce (+ residual, LayerNorm) -> GEMM", comm="all_reduce", shapes=SHAPES,
            setup=setup, part_titles={"comm": "all-reduce", "gemm": "cuBLAS GEMM"},
            floor_title="floor = max(all-reduce, GEMM)", params_from_suffix=_suffix,
            observed="all_reduce_matmul")
