"""A model of the MLP chain's two tile grids on the SMs: a bound on what tile flags can buy over
stream sync.

    python benchmarks/chain_model.py   (the bound on the shapes of ``chain_graph.py``)

Stream sync runs fc1's tiles in waves over every SM, then fc2's; each GEMM's last wave
leaves SMs idle when its tile count is not a multiple of the SMs. Tile flags (RowSync)
let an fc2 tile start once fc1's row block it reads is stored, on an SM fc1 no longer
needs. Whether that fills anything depends on the order fc1's tiles finish in: in GROUP_M
order a wave sweeps the N tiles of several row blocks together, so no row block is done
before fc1's last wave; in row-block order (``group_m`` 1) the first row blocks are done
after the first wave, and their fc2 tiles can run beside fc1's last.

The model lays the tables' tiles on ``sms`` SMs as the kernels hand them out (each tile,
in table order, to the SM that frees first; fc2's grid leaves ``reserve`` SMs to fc1, and
an fc2 tile holds its SM while it waits), every tile of one GEMM taking the same time: the
tile's work over its shape's relative rate (``autotune.TILE_RATE``). Units are one
128x256 tile's time per K element. It ignores memory traffic, the flags' own cost and a
partial wave running faster than a full one: an optimistic estimate of what flags can
buy (a bound in that sense), not a prediction. What it ignores decides on the GPU: the
order that stores row blocks early (``group_m`` 1) reads each weight about once per wave instead of once, and at M <= 1024
the GEMMs stream weights of up to 300 MB. GPT-3 175B at TP 4, M 512: the model's best
pair (128x256 tiles in row-block order, modelled 1.14x over the best stream sync) took
0.52 ms where the own picks in GROUP_M order took 0.45 (and 0.60 in row-block order);
``docs/experiments.md``, 2026-12-02. ``benchmarks/chain_graph.py`` reports the bound
beside the measured chain.

After the wave-quantization argument of cuSync (Jangda et al., "A Framework for
Fine-Grained Synchronization of Dependent GPU Kernels", CGO 2024).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Sequence

from overlap import protocol as P
from overlap.kernels.autotune import TILE_RATE, TILES, wave_model
from overlap.policies import rowsync_chain_tables

ORDERS = (1, 8)
"""``group_m`` values the model tries for each table (1: row-block order)."""


def tile_time(bm: int, bn: int, k: int) -> float:
    """Modelled time of one bm x bn tile over K ``k``, in 128x256 tiles per K element."""
    return bm * bn * k / (128 * 256) / TILE_RATE[(bm, bn)]


def sync_time(m: int, n: int, k: int, bm: int, bn: int, sms: int) -> float:
    """Modelled time of one GEMM's grid alone on ``sms`` SMs: whole waves of its tiles
    (the GEMM tuner's ``wave_model``, per K element)."""
    return wave_model(m, n, bm, bn, sms) * k


def flag_time(prod_rows: Sequence[int], cons_rows: Sequence[int], t_prod: float, t_cons: float, sms: int,
              reserve: int = 1) -> float:
    """Modelled end of the chain with RowSync: ``prod_rows`` / ``cons_rows`` are the row
    block of each producer / consumer tile in table order, ``t_prod`` / ``t_cons`` one
    tile's time. Producer tiles go to the SM that frees first; a consumer tile, in order,
    to the first of the ``sms - reserve`` SMs fc1 frees soonest, starting once its row
    block's last producer tile ends."""
    if sms <= reserve:
        raise ValueError(f"sms ({sms}) must exceed reserve ({reserve})")
    free = [0.0] * sms
    heapq.heapify(free)
    done: dict[int, float] = {}
    for rb in prod_rows:
        end = heapq.heappop(free) + t_prod
        done[rb] = max(done.get(rb, 0.0), end)
        heapq.heappush(free, end)
    slots = sorted(free)[:sms - reserve]
    heapq.heapify(slots)
    last = max(free)
    for rb in cons_rows:
        if rb not in done:
            raise ValueError(f"consumer row block {rb} has no producer tile")
        end = max(heapq.heappop(slots), done[rb]) + t_cons
        last = max(last, end)
        heapq.heappush(slots, end)
    return last


@dataclass(frozen=True)
class ChainPlan:
    """One tile pair and order, with its modelled times (units of ``tile_time``)."""

    block_m: int
    prod_block_n: int
    cons_block_n: int
    prod_group_m: int
    cons_group_m: int
    flag: float
    """Modelled time with tile flags (RowSync)."""
    sync: float
    """Modelled time of the same two grids stream-synced."""


def plan(m: int, k: int, f: int, n: int, block_m: int, prod_block_n: int, cons_block_n: int,
         prod_group_m: int, cons_group_m: int, sms: int, reserve: int = 1) -> ChainPlan:
    """The model of ``gelu(x[m, k] @ w1[k, f]) @ w2[f, n]`` with these tiles and orders."""
    prod, cons = rowsync_chain_tables(m, f, n, block_m, prod_block_n, cons_block_n, array=True,
                                      prod_group_m=prod_group_m, cons_group_m=cons_group_m)
    tp, tc = tile_time(block_m, prod_block_n, k), tile_time(block_m, cons_block_n, f)
    flag = flag_time((prod[:, P.COL_A_ROW] // block_m).tolist(), (cons[:, P.COL_A_ROW] // block_m).tolist(),
                     tp, tc, sms, reserve)
    sync = sync_time(m, f, k, block_m, prod_block_n, sms) + sync_time(m, n, f, block_m, cons_block_n, sms)
    return ChainPlan(block_m, prod_block_n, cons_block_n, prod_group_m, cons_group_m, flag, sync)


def plans(m: int, k: int, f: int, n: int, sms: int, *, block_ms: Iterable[int] = (128, 64), reserve: int = 1,
          orders: Iterable[int] = ORDERS) -> list[ChainPlan]:
    """Every tile pair of ``autotune.TILES`` with a BLOCK_M of ``block_ms`` in every pair
    of ``orders``, fastest modelled flag time first."""
    out = []
    orders = tuple(orders)
    for bm in block_ms:
        widths = [bn for tbm, bn in TILES if tbm == bm]
        for bp in widths:
            for bc in widths:
                for gp in orders:
                    for gc in orders:
                        out.append(plan(m, k, f, n, bm, bp, bc, gp, gc, sms, reserve))
    return sorted(out, key=lambda p: (p.flag, p.block_m != 128, p.prod_group_m, p.cons_group_m))


def best_sync(m: int, k: int, f: int, n: int, sms: int, *, block_ms: Iterable[int] = (128, 64)) -> float:
    """The modelled stream-synced time with each GEMM's fastest tile (shared BLOCK_M)."""
    best = float("inf")
    for bm in block_ms:
        widths = [bn for tbm, bn in TILES if tbm == bm]
        if widths:
            best = min(best, min(sync_time(m, f, k, bm, bn, sms) for bn in widths)
                       + min(sync_time(m, n, f, bm, bn, sms) for bn in widths))
    return best


def main() -> None:
    """The bound on ``chain_graph.py``'s shapes (132 SMs)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks.chain_graph import shapes

    for sh in shapes((512, 1024, 2048)):
        m, k, f = sh["m"], sh["k"], sh["f"]
        best = plans(m, k, f, k, 132)[0]
        print(f"{sh['model']:10s} TP{sh['tp']} M={m:5d}: bound {best_sync(m, k, f, k, 132) / best.flag:.3f}x "
              f"(fc1 {best.block_m}x{best.prod_block_n} group_m {best.prod_group_m}, "
              f"fc2 {best.block_m}x{best.cons_block_n} group_m {best.cons_group_m})")


if __name__ == "__main__":
    main()
