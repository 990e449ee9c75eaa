"""The run's context, written beside every figure: GPU, versions, commit, date, knobs."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from typing import Any

KNOBS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_DEBUG", "NCCL_MAX_CTAS",
         "OVERLAP_WAIT_TIMEOUT_MS", "CUDA_DEVICE_MAX_CONNECTIONS", "TRITON_INTERPRET")


def _commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha or "unknown") + ("+dirty" if dirty else "")
    except Exception:
        return os.environ.get("OVERLAP_COMMIT", "unknown")


def _host_us_torch_mm(calls: int = 300) -> float:
    """Host microseconds to queue one small torch.mm: a yardstick of the machine
    instance's host speed (it moves by up to 2x between instances), beside which the
    small, host-bound shapes of different runs can be compared."""
    import time

    import torch

    a = torch.randn(256, 256, device="cuda")
    for _ in range(20):
        torch.mm(a, a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        torch.mm(a, a)
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return round(us, 1)


def run_context(world_size: int | None = None) -> dict[str, Any]:
    import torch

    ctx: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("OVERLAP_COMMIT") or _commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "world_size": world_size,
        "knobs": {k: os.environ[k] for k in KNOBS if k in os.environ},
    }
    try:
        import triton

        ctx["triton"] = triton.__version__
    except Exception:
        ctx["triton"] = None
    if torch.cuda.is_available():
        ctx["gpu"] = torch.cuda.get_device_name()
        ctx["gpu_count"] = torch.cuda.device_count()
        ctx["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        ctx["cuda"] = torch.version.cuda
        try:
            ctx["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            ctx["nccl"] = None
        ctx["host_us_torch_mm"] = _host_us_torch_mm()
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
            ctx["driver"] = out[0] if out else None
        except Exception:
            ctx["driver"] = None
    else:
        ctx["gpu"] = None
        ctx["note"] = "CPU run: figures are not GPU figures"
    try:
        import cupy

        ctx["cupy"] = cupy.__version__
    except Exception:
        ctx["cupy"] = None
    return ctx
