"""The GEMM config cache of overlap.kernels.autotune, without a GPU."""

from __future__ import annotations

import importlib
import json
from dataclasses import asdict

import pytest
import torch

pytest.importorskip("triton")


@pytest.fixture
def autotune(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("OVERLAP_GEMM_CACHE", str(tmp_path / "gemm.json"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    import overlap.kernels.autotune as mod

    return importlib.reload(mod)  # fresh in-process cache


def test_cached_config_is_used_without_timing(autotune, tmp_path) -> None:
    from overlap.kernels.tile_gemm import GemmConfig

    want = GemmConfig(block_m=64, block_n=128, block_k=64, num_stages=4, num_warps=4)
    key = autotune._key("Fake GPU", 256, 512, 1024, torch.bfloat16, False, None)
    (tmp_path / "gemm.json").write_text(json.dumps({key: {"config": asdict(want), "ms": {}}}))
    # a hit returns before any tensor is made: no GPU needed
    assert autotune.tune_gemm(256, 512, 1024, dtype=torch.bfloat16, device="cpu", b_kn=False) == want
    # a different layout or block_m is a different entry: a miss needs a GPU
    assert autotune._key("Fake GPU", 256, 512, 1024, torch.bfloat16, True, None) != key
    assert key in autotune.cached_configs()


def test_block_m_filter(autotune) -> None:
    with pytest.raises(ValueError, match="block_m=32"):
        autotune.tune_gemm(256, 512, 1024, dtype=torch.bfloat16, device="cpu", block_m=32)
    assert {c.block_m for c in autotune.CANDIDATES} >= {64, 128}


def test_save_is_atomic_and_round_trips(autotune, tmp_path) -> None:
    autotune._cache["k"] = {"config": {"block_m": 128}, "ms": {"x": 1.0}}
    autotune._save()
    assert json.loads((tmp_path / "gemm.json").read_text())["k"]["ms"] == {"x": 1.0}
    assert [p.name for p in tmp_path.iterdir()] == ["gemm.json"]
