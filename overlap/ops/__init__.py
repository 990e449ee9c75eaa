"""Fused communication + GEMM operations, each with a plain ``*_ref``."""

from .all_gather import (
    all_gather_matmul,
    all_gather_matmul_chunked,
    all_gather_matmul_ref,
    tune_all_gather_matmul,
)
from ._runtime import OverlapConfig

__all__ = [
    "OverlapConfig",
    "all_gather_matmul",
    "all_gather_matmul_chunked",
    "all_gather_matmul_ref",
    "tune_all_gather_matmul",
]
