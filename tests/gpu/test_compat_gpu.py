"""overlap.compat and the N-D top-level ops on CUDA (fp16 / bf16, the tile-flag path), and
Inductor's async-TP pass emitting them: one GPU (world size 1) and two (torchrun)."""

from __future__ import annotations

import re

import pytest

from tests._procs import REPO, run_cmd

W = str(REPO / "tests" / "_compat_worker.py")
I = str(REPO / "tests" / "_inductor_tp_worker.py")


@pytest.mark.gpu
def test_compat_one_gpu() -> None:
    r = run_cmd(["bash", "launch/torchrun.sh", "1", W, "cuda"], timeout_s=400)
    assert r.returncode == 0 and re.search(r"^PASS compat rank=0 world=1 device=cuda", r.out, re.M), r.out[-6000:]


@pytest.mark.gpu2
@pytest.mark.parametrize("script,tag", [(W, "compat"), (I, "inductor_tp")])
def test_compat_two_gpus(script: str, tag: str) -> None:
    r = run_cmd(["bash", "launch/torchrun.sh", "2", script, "cuda"], timeout_s=400)
    assert r.returncode == 0 and len(re.findall(rf"^PASS {tag} rank=\d world=2 device=cuda", r.out, re.M)) == 2, \
        r.out[-6000:]
