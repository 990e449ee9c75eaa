"""overlap.models.checkpoint: a checkpoint file that is corrupt, truncated or not a
checkpoint raises CheckpointError naming the file and the fault, fast, before any state is
used; a good one round-trips with weights_only=True."""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest
import torch

from overlap.models import GPT, GPTConfig, checkpoint
from overlap.models.checkpoint import CheckpointError

CONFIG = {"layout": {"world_size": 2, "tp_size": 2}, "args": {"steps": 20}}


def _state() -> dict:
    model = GPT(GPTConfig(vocab_size=33, block_size=32, n_layer=2, n_head=4, n_embd=64), seed=0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 8, dtype=torch.int64))[1].backward()
    opt.step()
    return {"step": 10, "model": model.state_dict(), "optimizer": opt.state_dict(),
            "data_rng": torch.Generator().manual_seed(3).get_state(), "torch_rng": torch.get_rng_state(),
            "cuda_rng": None, "history": [{"step": 0, "loss": 3.5, "tokens_per_s": 1e4}], "val": []}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("ckpt") / "rank0.pt"
    state = _state()
    checkpoint.save(path, state, CONFIG)
    return path, state


def test_round_trip(saved: tuple[Path, dict]) -> None:
    path, state = saved
    loaded, config = checkpoint.load(path)
    assert config == CONFIG and checkpoint.read_config(path) == CONFIG
    assert loaded["step"] == 10 and loaded["history"] == state["history"]
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v), k
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert not list(path.parent.glob("*.tmp"))  # written by rename


def _damaged(saved: tuple[Path, dict], tmp_path: Path, at: int, data: bytes) -> Path:
    raw = bytearray(saved[0].read_bytes())
    raw[at:at + len(data)] = data
    bad = tmp_path / "rank0.pt"
    bad.write_bytes(bytes(raw))
    return bad


def _refused(path: Path, match: str) -> str:
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=match) as e:
        checkpoint.load(path)
    assert time.perf_counter() - t0 < 5.0
    assert str(path) in str(e.value)
    return str(e.value)


def test_random_bytes_mid_file(saved: tuple[Path, dict], tmp_path: Path) -> None:
    size = saved[0].stat().st_size
    noise = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    _refused(_damaged(saved, tmp_path, size // 2 - 2048, noise.numpy().tobytes()), "corrupt: the SHA-256")


def test_0x7f_in_a_weight(saved: tuple[Path, dict], tmp_path: Path) -> None:
    """64 bytes of 0x7f (a NaN pattern in fp32) written over the middle of a weight's data."""
    path, state = saved
    w = state["model"]["h.1.mlp.fc1.weight"]
    raw = path.read_bytes()
    at = raw.find(w.numpy().tobytes())
    assert at > 0, "the weight's bytes are not stored contiguously in the file"
    _refused(_damaged(saved, tmp_path, at + w.numel() * 2, b"\x7f" * 64), "corrupt")


def test_truncated(saved: tuple[Path, dict], tmp_path: Path) -> None:
    bad = tmp_path / "rank0.pt"
    bad.write_bytes(saved[0].read_bytes()[:-100])
    _refused(bad, "truncated")


def test_a_plain_torch_save_file(saved: tuple[Path, dict], tmp_path: Path) -> None:
    bad = tmp_path / "rank0.pt"
    torch.save({"model": saved[1]["model"], "step": 10}, bad)
    assert "plain torch.save" in _refused(bad, "not an overlap checkpoint")
    with pytest.raises(CheckpointError, match="not an overlap checkpoint"):
        checkpoint.read_config(bad)


def test_code_in_the_payload_is_not_run(tmp_path: Path) -> None:
    """A payload whose checksum matches but which unpickles to code (a crafted file) is
    refused by weights_only=True; the code never runs."""
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('ran code')",))

    path = tmp_path / "rank0.pt"
    checkpoint.save(path, {"step": 1}, CONFIG)
    raw = path.read_bytes()
    payload = pickle.dumps(Boom(), protocol=2)
    import hashlib
    import json

    header = json.dumps({"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(), "config": CONFIG})
    path.write_bytes(checkpoint.MAGIC + header.encode() + b"\n" + payload)
    assert raw != path.read_bytes()
    _refused(path, "weights_only")


def test_missing_and_garbled_header(tmp_path: Path) -> None:
    _refused(tmp_path / "nope.pt", "cannot read")
    bad = tmp_path / "rank0.pt"
    bad.write_bytes(checkpoint.MAGIC + b"{not json\n" + b"x" * 100)
    _refused(bad, "header is unreadable")
