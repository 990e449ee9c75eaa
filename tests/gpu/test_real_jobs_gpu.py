"""Real jobs: a rank or producer seconds late with default settings (one GPU and two),
and the ops beside a data-parallel all-reduce on torch's communicator (two GPUs). See
skew_check.py, gate_check.py and real_jobs2_check.py."""

from __future__ import annotations

import re

import pytest

from tests._procs import REPO, run_cmd


@pytest.mark.gpu
def test_late_producer_one_gpu() -> None:
    r = run_cmd(["bash", "launch/torchrun.sh", "1", "tests/gpu/skew_check.py"], timeout_s=300)
    assert re.search(r"^PASS skew1 ", r.out, re.M), r.out[-6000:]
    print(re.search(r"^PASS skew1 .*$", r.out, re.M).group(0))


@pytest.mark.gpu
def test_stream_gate_frees_the_gpu_while_a_chunk_is_late() -> None:
    r = run_cmd(["bash", "launch/torchrun.sh", "1", "tests/gpu/gate_check.py"], timeout_s=300)
    assert re.search(r"^PASS gate1 ", r.out, re.M), r.out[-6000:]
    print(re.search(r"^PASS gate1 .*$", r.out, re.M).group(0))


@pytest.mark.gpu2
def test_late_rank_two_gpus() -> None:
    r = run_cmd(["bash", "launch/torchrun.sh", "2", "tests/gpu/real_jobs2_check.py", "skew"], timeout_s=600)
    assert re.search(r"^PASS skew ", r.out, re.M), r.out[-8000:]
    print(re.search(r"^PASS skew .*$", r.out, re.M).group(0))


@pytest.mark.gpu2
def test_beside_data_parallel_all_reduce_two_gpus() -> None:
    # the rule of docs/guarantees.md ("Other NCCL traffic"): torch's NCCL CTAs capped, and
    # the ops leave at least that many SMs free
    env = {"NCCL_MAX_CTAS": "16", "OVERLAP_SM_MARGIN": "16", "NCCL_NVLS_ENABLE": "0"}
    r = run_cmd(["bash", "launch/torchrun.sh", "2", "tests/gpu/real_jobs2_check.py", "ddp"], timeout_s=600, env=env)
    assert re.search(r"^PASS ddp ", r.out, re.M), r.out[-8000:]
    print(re.search(r"^PASS ddp .*$", r.out, re.M).group(0))
