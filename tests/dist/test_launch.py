"""launch/: torchrun.sh and mpirun.sh end to end, and the GPT-block demo's TP math."""

from __future__ import annotations

import importlib.util
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests._procs import REPO, run_cmd

SMALL = ["--hidden", "256", "--heads", "8", "--seq", "32", "--batch", "2", "--iters", "2"]


def _load_demo():
    spec = importlib.util.spec_from_file_location("gpt_block_demo", REPO / "launch/gpt_block_demo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpt_block_demo", mod)
    spec.loader.exec_module(mod)
    return mod


demo = _load_demo()


def _thread_all_reduce(n: int) -> Callable[[int], Callable[[torch.Tensor], torch.Tensor]]:
    """all_reduce(sum) across n threads, one per simulated rank."""
    barrier = threading.Barrier(n, timeout=30)
    slots: list[torch.Tensor | None] = [None] * n

    def for_rank(r: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            slots[r] = t.clone()
            barrier.wait()
            total = sum(slots)  # same order on every rank: same result everywhere
            barrier.wait()
            t.copy_(total)
            return t
        return all_reduce

    return for_rank


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_block_matches_unsharded(tp: int) -> None:
    """The demo's shard_weights + block_forward, with tp ranks simulated in threads."""
    H, nh = 64, 8
    full = demo.make_weights(H, device=torch.device("cpu"), dtype=torch.float64, seed=3)
    for call in range(2):  # a new input each call
        x = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(call), dtype=torch.float64)
        ref = demo.block_forward(x, full, nh, lambda t: t)
        reduce_for = _thread_all_reduce(tp)
        outs: list[torch.Tensor | None] = [None] * tp

        def rank(r: int, x: torch.Tensor, outs: list, reduce_for: Callable) -> None:
            w = demo.shard_weights(full, heads=nh, tp_rank=r, tp_size=tp)
            assert w.w_qkv.shape == (3 * H // tp, H) and w.w_fc2.shape == (H, 4 * H // tp)
            outs[r] = demo.block_forward(x.clone(), w, nh // tp, reduce_for(r))

        threads = [threading.Thread(target=rank, args=(r, x, outs, reduce_for)) for r in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        for out in outs:
            torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def _demo_ok(out: str) -> None:
    assert "check: PASS" in out, out
    assert re.search(r"forward: [\d.]+ ms/iter", out), out
    if not torch.cuda.is_available():
        assert "CPU reference path; figures are not GPU figures" in out, out


@pytest.mark.parametrize("path", ["reference", "overlap"])
def test_demo_under_torchrun_sh(path: str) -> None:
    r = run_cmd(["bash", "launch/torchrun.sh", "2", "launch/gpt_block_demo.py", *SMALL, "--path", path],
                timeout_s=120)
    assert r.returncode == 0, r
    _demo_ok(r.out)
    assert "tp=2, world=2" in r.out, r
    assert f"path: {path} (" in r.out, r


@pytest.mark.mpi
def test_demo_under_mpirun_sh() -> None:
    r = run_cmd(["bash", "launch/mpirun.sh", "2", "launch/gpt_block_demo.py", *SMALL], timeout_s=120)
    assert r.returncode == 0, r
    _demo_ok(r.out)


def test_groups_under_torchrun_agent_store() -> None:
    """Real torchrun (its agent hosts the store; every rank is a client), 4 ranks."""
    r = run_cmd(["bash", "launch/torchrun.sh", "4", "tests/_dist_worker.py", "groups"], timeout_s=120)
    assert r.returncode == 0, r
    assert all(f"PASS groups rank={i}" in r.out for i in range(4)), r


def test_module_entry_under_torchrun_sh(tmp_path: Path) -> None:
    (tmp_path / "probe_mod.py").write_text(
        # one write per rank: the ranks share the pipe, and print's pieces could interleave
        "import os, sys\nline = f\"PROBE {os.environ['RANK']} {os.environ['NCCL_NVLS_ENABLE']} {sys.argv[1:]}\\n\"\n"
        "os.write(1, line.encode())\n")
    r = run_cmd(["bash", "launch/torchrun.sh", "2", "-m", "probe_mod", "--flag", "x"], timeout_s=60,
                env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r
    for rank in (0, 1):
        assert f"PROBE {rank} 0 ['--flag', 'x']" in r.out, r


@pytest.mark.parametrize(
    "argv", [[], ["2"], ["x", "launch/gpt_block_demo.py"], ["0", "launch/gpt_block_demo.py"],
             ["2", "no_such_file.py"], ["2", "-m"]],
)
@pytest.mark.parametrize("script", ["launch/torchrun.sh", "launch/mpirun.sh"])
def test_launcher_usage_errors(script: str, argv: list[str]) -> None:
    r = run_cmd(["bash", script, *argv], timeout_s=30)
    assert r.returncode == 2, r
