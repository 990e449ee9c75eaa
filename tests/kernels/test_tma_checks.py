"""Operands TMA cannot read are refused up front (the ops check before queueing any work)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from overlap.kernels.tile_gemm import check_b, check_tma  # noqa: E402


def test_check_tma_rows_and_base() -> None:
    base = torch.zeros(64, 64, dtype=torch.float16)
    check_tma("a", base)  # 128-byte rows from an aligned start
    with pytest.raises(ValueError, match="16-byte"):
        check_tma("a", base.view(-1)[3:3 + 32 * 64].view(32, 64))  # start 6 bytes in
    with pytest.raises(ValueError, match="row stride 60"):
        check_tma("a", base[:, :60].contiguous().view(64, 60)[:, :56])  # 120-byte rows


def test_check_b_layouts() -> None:
    w = torch.zeros(128, 64, dtype=torch.bfloat16)  # nn.Linear weight [N, K]
    check_b(w.t())  # its transpose: read in place
    check_b(w.t().contiguous())  # row-major [K, N]
    with pytest.raises(ValueError, match="16-byte"):
        check_b(w[:, 3:59].t())  # columns 3.. of the weight: every row starts 6 bytes in


def test_gemm_plan_refuses_operands_of_another_layout() -> None:
    from overlap.kernels.tile_gemm import TileGemmPlan
    from overlap.policies import Segment, build_tile_table

    a = torch.zeros(64, 128, dtype=torch.bfloat16)
    w = torch.zeros(32, 128, dtype=torch.bfloat16)  # nn.Linear weight [N, K]
    c = torch.zeros(64, 32, dtype=torch.bfloat16)
    table = torch.tensor(build_tile_table([Segment(0, 0, 0, 64)], 32, 64, 32), dtype=torch.int32)
    plan = TileGemmPlan(a, w.t(), c, table)
    descs = plan.operands(torch.ones_like(a), w.t().clone().t().t())  # same layouts, other storage
    assert descs[0] is descs[1] and tuple(descs[2].shape) == (32, 128)
    with pytest.raises(ValueError, match="plan's"):
        plan.operands(a, w.t().contiguous())  # B row-major [K, N]: not the plan's layout
    with pytest.raises(ValueError, match="plan's"):
        plan.operands(torch.zeros(64, 256, dtype=torch.bfloat16)[:, :128], w.t())  # A with another row stride
    with pytest.raises(ValueError, match="a2"):
        plan.operands(a, w.t(), a)
    with pytest.raises(ValueError, match="plan's"):
        plan.launch(descs, torch.zeros(64, 64, dtype=torch.bfloat16)[:, :32], epoch=1, grid=1)


def test_gemm_plan_takes_a_b_it_reads_through_a_copy() -> None:
    from overlap.kernels.tile_gemm import TileGemmPlan
    from overlap.policies import Segment, build_tile_table

    a = torch.zeros(64, 128, dtype=torch.bfloat16)
    b = torch.ones(128, 64, dtype=torch.bfloat16)[:, ::2]  # [K, N] with a column stride of 2
    c = torch.zeros(64, 32, dtype=torch.bfloat16)
    table = torch.tensor(build_tile_table([Segment(0, 0, 0, 64)], 32, 64, 32), dtype=torch.int32)
    plan = TileGemmPlan(a, b, c, table)
    descs = plan.operands(a, torch.full((128, 64), 2.0, dtype=torch.bfloat16)[:, ::2])
    assert descs[2].base.is_contiguous() and float(descs[2].base[0, 0]) == 2.0
