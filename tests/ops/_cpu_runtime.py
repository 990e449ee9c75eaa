"""Runtimes (``overlap.ops._runtime.Runtime``) on the CPU, for tests of what the ops keep
on them: the constructor asks CUDA for the SM count and three streams, which
``cuda_stand_ins`` stands in for (nothing in these tests launches work on a stream)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch

from overlap.ops._runtime import Runtime


@contextlib.contextmanager
def cuda_stand_ins(num_sms: int = 132) -> Iterator[None]:
    """While open, runtimes can be made on a CPU device (``get_runtime``, ``local_runtime``)."""
    props = SimpleNamespace(multi_processor_count=num_sms)
    with mock.patch.object(torch.cuda, "get_device_properties", lambda device: props), \
            mock.patch.object(torch.cuda, "Stream", lambda **kw: object()):
        yield


def cpu_runtime(group: Any = None, num_sms: int = 132) -> Runtime:
    """A runtime of rank 0 of one on the CPU (``group``: for the agreement check's gather)."""
    with cuda_stand_ins(num_sms):
        return Runtime(group, (0,), 0, torch.device("cpu"))
