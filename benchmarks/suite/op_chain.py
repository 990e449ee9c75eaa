"""MLP chain on one GPU: ``y = gelu(x @ w1) @ w2`` (overlap.ops.mlp_chain), fc2's tiles
starting as fc1's row blocks finish (tile flags inside one GPU; no communication).

Shapes M x N x K: x [M, K], w1 [K, N], w2 [N, K] (N is the FFN slice, K the hidden size):
GPT-3 175B MLP slice at TP = 8 (K = 12288, N = 6144) and LLaMA-65B's (K = 8192,
N = 22016 / 8 = 2752), M = 256 ... 4096. Variants: torch (cuBLAS + gelu), stream-sync (the
two tile kernels, stream-ordered), tile-flag (row-block flags, RowSync), tile-flag (tile:
per-tile flags, TileSync, waits inside fc2's K loop); on CUDA the
library's chain tuner picks both tile kernels' configs first. Every rank runs the chain
on its own GPU; figures are the slowest rank's. There is no overlap floor: the sequential figure
is producer alone (fc1 + gelu, cuBLAS) + consumer alone (fc2, cuBLAS), and the report gives
tile-flag's speedup over stream-sync. On CPU only mlp_chain_ref runs.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .oputil import NEEDS_CUDA, fast_path_counter
from .spec import Case, Env, OpSpec, Shape, Variant, mnk

ROWS = (256, 512, 1024, 2048, 4096)
SHAPES = {
    "gpt3-175b": [mnk("gpt3-175b", m, 6144, 12288, name="mlp / 8") for m in ROWS],
    "llama-70b": [mnk("llama-70b", m, 2752, 8192, name="llama-65b mlp / 8") for m in ROWS],
}


def gemm_config(c: object) -> str:
    """``128x256x64 s3 w8`` for a tile GEMM config (None: the default)."""
    if c is None:
        return "default"
    return f"{c.block_m}x{c.block_n}x{c.block_k} s{c.num_stages} w{c.num_warps}"


def setup(shape: Shape, env: Env) -> Case:
    from overlap.ops import mlp_chain_ref

    m, n, k = shape.dims["M"], shape.dims["N"], shape.dims["K"]
    x = env.randn(m, k, seed=1000 * env.rank + m + n + k)
    w1 = env.randn(k, n, seed=7, scale=k ** -0.5)
    w2 = env.randn(n, k, seed=8, scale=n ** -0.5)
    hid = env.randn(m, n, seed=9)
    variants = {"torch": Variant("torch (cuBLAS + gelu)", fn=lambda: mlp_chain_ref(x, w1, w2), role="reference",
                                 synced=True)}
    if env.on_gpu:
        from overlap.ops import mlp_chain, mlp_chain_stream_sync

        variants["stream_sync"] = Variant("stream-sync", fn=lambda: mlp_chain_stream_sync(x, w1, w2))
        tune = getattr(sys.modules[mlp_chain.__module__], "tune_mlp_chain", None)
        if env.tune and tune is not None:
            def tuned() -> dict[str, str]:
                cfg = tune(x, w1, w2, verbose=env.verbose)
                return {"fc1": gemm_config(cfg.producer), "fc2": gemm_config(cfg.consumer or cfg.producer)}

            # the tuner picks both tile kernels' configs, which stream-sync and tile-flag share
            variants["stream_sync"].prepare = tuned
        variants["tile_flag"] = Variant("tile-flag (row)", fn=lambda: mlp_chain(x, w1, w2, sync="row"),
                                        role="library", synced=True, counter=fast_path_counter(mlp_chain))
        variants["tile_sync"] = Variant("tile-flag (tile)", fn=lambda: mlp_chain(x, w1, w2, sync="tile"),
                                        counter=fast_path_counter(mlp_chain))

        def check() -> dict[str, float]:
            x2 = torch.randn_like(x)
            ref = mlp_chain_ref(x2, w1, w2)
            return {"rel_err": env.rel_err(mlp_chain(x2, w1, w2, sync="row"), ref),
                    "rel_err_tile_sync": env.rel_err(mlp_chain(x2, w1, w2, sync="tile"), ref),
                    "rel_err_stream_sync": env.rel_err(mlp_chain_stream_sync(x2, w1, w2), ref)}

        def finish() -> None:  # a flag-wait timeout the chain recorded (on its device's runtime)
            mod = sys.modules[mlp_chain.__module__]
            mod._runtime(x.device).err(mod.OP).check(block=True)
    else:
        variants["stream_sync"] = Variant("stream-sync", na=NEEDS_CUDA)
        variants["tile_flag"] = Variant("tile-flag (row)", role="library", na=NEEDS_CUDA)
        variants["tile_sync"] = Variant("tile-flag (tile)", na=NEEDS_CUDA)
        check = finish = None
    parts = {"producer": lambda: F.gelu(x @ w1), "consumer": lambda: hid @ w2}
    return Case(variants=variants, parts=parts, flops=4.0 * m * n * k, check=check, finish=finish)


OP = OpSpec(name="chain", title="MLP chain fc1 -> gelu -> fc2 (one GPU per rank)", comm=None, shapes=SHAPES,
            setup=setup, library="tile_flag", floor="sum",
            part_titles={"producer": "fc1+gelu alone", "consumer": "fc2 alone"},
            floor_title="sequential = producer + consumer", speedup=("tile_flag", "stream_sync"), observed="mlp_chain")
