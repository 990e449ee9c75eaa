"""The warp-specialized Gluon GEMM on the GPU (``benchmarks/gluon_gemm_bench.py``'s checks):
fresh inputs and NaN-poisoned outputs every call, both B layouts, bf16 and fp16, ragged
edges, two A sources; tiles waiting on flags already set, set late by another stream, never
set (error word, bounded) and set two epochs ahead; tiles from a dispatch counter shared by
two launches."""

from __future__ import annotations

import pytest
import torch


def _need_gluon() -> None:
    from overlap.kernels import gluon_gemm

    if not gluon_gemm.AVAILABLE:
        pytest.skip(gluon_gemm.REASON)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon GEMM is built for sm_90")


@pytest.mark.gpu
def test_gluon_gemm_matches_torch() -> None:
    _need_gluon()
    from benchmarks.gluon_gemm_bench import check_plain

    log: list[str] = []
    check_plain(log)
    assert log and "right" in log[0]


@pytest.mark.gpu
def test_gluon_gemm_tiles_wait() -> None:
    _need_gluon()
    from benchmarks.gluon_gemm_bench import check_waits

    log: list[str] = []
    check_waits(log)
    from benchmarks.gluon_gemm_bench import VARIANTS

    assert len(log) == len(VARIANTS)


@pytest.mark.gpu
def test_gluon_gemm_dispatch_counter() -> None:
    _need_gluon()
    from benchmarks.gluon_gemm_bench import DYNAMIC_VARIANTS, VARIANTS, check_dynamic

    log: list[str] = []
    check_dynamic(log, {kk: VARIANTS[kk] for kk in DYNAMIC_VARIANTS})
    assert len(log) == len(DYNAMIC_VARIANTS)
