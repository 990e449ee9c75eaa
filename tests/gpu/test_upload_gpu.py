"""Plans uploaded on the hot path do not make the host wait for the GPU (overlap.policies.upload)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch


@pytest.mark.gpu
def test_upload_does_not_wait_for_queued_work() -> None:
    from overlap.policies import table_tensor, upload

    # about 0.5 s of queued work on the current stream
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(50_000_000)
    e.record()
    e.synchronize()
    cycles = int(50_000_000 * 500 / s.elapsed_time(e))
    for make in (lambda: upload(np.arange(1000, dtype=np.int64), "cuda"),
                 lambda: table_tensor(np.arange(64, dtype=np.int32).reshape(8, 8), "cuda")):
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        t = make()
        host_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        assert host_s < 0.1, f"the upload waited {host_s:.3f} s for the stream's queued work"
        assert t.is_cuda and torch.equal(t.cpu().flatten(), torch.arange(t.numel(), dtype=t.dtype))
