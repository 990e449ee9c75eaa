"""GPU correctness of the intra-GPU chain mlp_chain (one process, one GPU).

Fresh inputs on every call (a consumer tile reading fc1's rows before they
were stored would read the last call's and fail), M not a multiple of the
tile, both weight layouts, fp16 and bf16, RowSync and TileSync, many epochs, and the consumer
enqueued first with the producer held back on its stream: it must still
finish, correct, without a timeout. Where programmatic dependent launch is taken
(``pdl_supported``), the same with ``ChainConfig(launch="pdl")``, back to back over
many epochs and replayed in a CUDA graph with new inputs. Prints ``PASS chain``.

``--engine tile|auto|gluon`` (``OVERLAP_GEMM_ENGINE``; default tile): the engine of fc2 in
the chain and in its stream-synced baseline. On the tile GEMM both run the same kernel
and must agree bit for bit; where either may run the Gluon GEMM (whose sums may round
apart) they must agree to 1e-2 relative, and both against float64 as before. The PASS
line lists the engines fc2 took (``engines=``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
# the launch cache's counts below are of eager calls: plan graphs replay without launches
# (tests/gpu/plan_graphs_check.py checks the chain's)
os.environ["OVERLAP_PLAN_GRAPHS"] = "off"
_ap = argparse.ArgumentParser()
_ap.add_argument("--engine", choices=("tile", "auto", "gluon"), default="tile")
ENGINE = _ap.parse_args().engine
os.environ["OVERLAP_GEMM_ENGINE"] = ENGINE

from overlap.kernels.tile_gemm import GemmConfig  # noqa: E402
from overlap.ops import chain as chmod  # noqa: E402


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()


def same(y: torch.Tensor, y_ss: torch.Tensor) -> bool:
    """The chain's output against the stream-synced baseline's (see the module's doc)."""
    return torch.equal(y, y_ss) if ENGINE == "tile" else rel(y, y_ss) <= 1e-2


def launches() -> tuple[int, int]:
    """(hits, misses) of the tile GEMM's and the Gluon GEMM's cached launches."""
    from overlap.kernels import gluon_gemm, tile_gemm

    lcs = [tile_gemm._launcher] + (list(gluon_gemm._LAUNCHERS.values()) if gluon_gemm.AVAILABLE else [])
    return sum(lc.hits for lc in lcs), sum(lc.misses for lc in lcs)


def ref64(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x.double() @ w1.double()) @ w2.double()


def main() -> None:
    dev = torch.device("cuda", 0)
    # load the delay kernel now: loading a module while a kernel spins on the GPU waits
    # for that kernel (CUDA lazy loading), which would hold the producer back past the bound
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    small = GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=8)
    cases = [
        # (M, K, F, N, dtype, layout, config)
        (256, 1024, 768, 1024, torch.bfloat16, "wt", None),
        (1000, 512, 1536, 512, torch.float16, "kn", None),    # M not a multiple of 128
        (777, 768, 512, 1024, torch.bfloat16, "wt", small),
        (2048, 2048, 2048, 2048, torch.bfloat16, "kn", small),
    ]
    from overlap.kernels.tile_gemm import pdl_supported

    pdl = pdl_supported(dev)
    runs = [(False, "row", "streams"), (True, "row", "streams"), (False, "tile", "streams"),
            (True, "tile", "streams")]
    if pdl:
        # the producer held back on the stream ahead of both kernels (consumer_first is
        # not a PDL order: the dependent launch is the consumer's by construction)
        runs += [(False, "row", "pdl"), (False, "tile", "pdl")]
    calls = 0
    for (m, k, f, n, dt, layout, gcfg) in cases:
        for consumer_first, sync, launch in runs:
            cfg = chmod.ChainConfig(producer=gcfg, check="sync", sync=sync, launch=launch)
            for it in range(5):
                g = torch.Generator(device=dev).manual_seed(100 * it + m + int(consumer_first))
                x = torch.randn(m, k, device=dev, dtype=dt, generator=g)
                w1 = torch.randn(f, k, device=dev, dtype=dt, generator=g) / k ** 0.5
                w2 = torch.randn(n, f, device=dev, dtype=dt, generator=g) / f ** 0.5
                b1, b2 = (w1.t(), w2.t()) if layout == "wt" else (w1.t().contiguous(), w2.t().contiguous())
                # consumer first, producer held back ~10 ms on its stream: consumer programs are
                # resident and spinning before any producer program starts
                y = chmod._mlp_chain(x, b1, b2, config=cfg, consumer_first=consumer_first,
                                     producer_delay_cycles=20_000_000 if consumer_first else 0)
                y_ss = chmod.mlp_chain_stream_sync(x, b1, b2, config=cfg)
                y_t = chmod.mlp_chain_ref(x, b1, b2)
                r64 = ref64(x, b1, b2)
                e, e_t = rel(y, r64), rel(y_t, r64)  # (stream-sync: bit-equal to the chain, below)
                what = (m, k, f, n, dt, layout, consumer_first, sync, launch)
                assert same(y, y_ss), f"chain differs from stream-sync: {what} it {it}"
                assert e <= 2 * e_t + 2e-3, f"case {what} it {it}: {e:.2e} vs {e_t:.2e}"
                calls += 1
    assert chmod.stats["fused"] >= calls
    # many epochs, inputs changing every call, async error checks
    x = torch.randn(512, 512, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(512, 512, device=dev, dtype=torch.bfloat16) / 512 ** 0.5
    w2 = torch.randn(512, 512, device=dev, dtype=torch.bfloat16) / 512 ** 0.5
    hits0, misses0 = launches()
    t0 = time.time()
    for it in range(300):
        xi = x * (1 + it % 7)
        y = chmod.mlp_chain(xi, w1, w2, sync="tile" if it % 2 else "row")
        if it % 50 == 0 or it == 299:
            assert same(y, chmod.mlp_chain_stream_sync(xi, w1, w2)), f"epoch {it}"
    torch.cuda.synchronize()
    chmod._runtime(dev).err(chmod.OP).check(block=True)
    if pdl:
        # back to back, no sync between calls: a producer that wrote anything after the
        # consumer ended would race the next call's zeroing of the counters and flags
        pc = chmod.ChainConfig(launch="pdl")
        outs = []
        for it in range(300):
            xi = x * (1 + it % 7)
            outs.append((it, xi, chmod.mlp_chain(xi, w1, w2, config=pc, sync="tile" if it % 3 == 2 else "row")))
            if len(outs) == 50:
                for j, xj, yj in outs[::7]:
                    assert same(yj, chmod.mlp_chain_stream_sync(xj, w1, w2)), f"pdl epoch {j}"
                outs.clear()
        torch.cuda.synchronize()
        chmod._runtime(dev).err(chmod.OP).check(block=True)
        # a failure recorded before a call (as after a timeout not yet reported): the
        # consumer's tiles skip their waits and work, the call reports it, and the next
        # call computes again, its flags and counters untouched by the failed call's producer
        from overlap import protocol as P
        ew = chmod._runtime(dev).err(chmod.OP)
        ew.word[P.ERR_CODE] = P.ERR_TIMEOUT
        try:
            chmod.mlp_chain(x, w1, w2, config=dataclasses.replace(pc, check="sync"))
        except Exception as e:  # noqa: BLE001 - the recorded failure, reported
            assert "FlagTimeout" in type(e).__name__, e
        else:
            raise AssertionError("a recorded failure was not reported")
        for it in range(3):
            xi = x * (2 + it)
            assert same(chmod.mlp_chain(xi, w1, w2, config=pc), chmod.mlp_chain_stream_sync(xi, w1, w2)), \
                f"pdl after a failure {it}"
        # captured in a CUDA graph, replayed with new inputs (a stale read fails)
        xg = x.clone()
        chmod.mlp_chain(xg, w1, w2, config=pc)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            yg = chmod.mlp_chain(xg, w1, w2, config=pc)
        for it in range(5):
            xg.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            assert same(yg, chmod.mlp_chain_stream_sync(xg, w1, w2)), f"pdl graph replay {it}"
        chmod._runtime(dev).err(chmod.OP).check(block=True)
    # after the first call of each kernel and policy, every launch reuses the compiled
    # kernel (an argument Triton would specialize differently, e.g. an unaligned
    # pointer, sends every launch through Triton's slower path)
    hits, misses = launches()
    assert misses - misses0 <= 8 + 8 * pdl + 8 * (ENGINE != "tile") and hits - hits0 >= 550, \
        (hits - hits0, misses - misses0)
    # the tuner: its pick (graph-timed candidates) is cached and taken by calls without a
    # config, with the default error check, and matches the stream-synced kernels
    xt = torch.randn(1000, 1024, device=dev, dtype=torch.bfloat16)
    w1t = torch.randn(1536, 1024, device=dev, dtype=torch.bfloat16).t() / 32
    w2t = torch.randn(1024, 1536, device=dev, dtype=torch.bfloat16).t() / 39
    tuned = chmod.tune_mlp_chain(xt, w1t, w2t, rounds=2)
    key = chmod._tune_key(xt, w1t, w2t, "gelu")
    assert chmod._tuned(chmod._runtime(dev)).get(key) == tuned and tuned.check == chmod.ChainConfig().check, tuned
    for it in range(3):
        xt.normal_()
        assert same(chmod.mlp_chain(xt, w1t, w2t), chmod.mlp_chain_stream_sync(xt, w1t, w2t)), f"tuned {it}"
    from overlap.kernels import engine

    took = sorted({label for _p, (label, _why) in engine.picks().items()})
    if ENGINE == "gluon":
        assert any(t.startswith("gluon") for t in took), took
    print(f"PASS chain calls={calls} epochs=300 pdl={pdl} ({time.time() - t0:.1f} s) stats={chmod.stats} "
          f"engines={','.join(t.replace(' ', '_') for t in took) or 'none'}", flush=True)


if __name__ == "__main__":
    main()
