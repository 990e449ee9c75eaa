"""Distributed start-up (moved from ``overlap/dist.py``; split into modules next)."""

from __future__ import annotations

from typing import Any

from . import context as _context
from .context import *  # noqa: F401,F403
from .context import __all__, _lock, _shutdown_hooks  # noqa: F401


def __getattr__(name: str) -> Any:
    # Per-process state that the module rebinds (the context, the last id exchange):
    # read it where it lives so ``overlap.dist._ctx`` stays current.
    if name.startswith("_") and not name.startswith("__") and hasattr(_context, name):
        return getattr(_context, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
