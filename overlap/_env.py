"""Optional and CUDA-only imports, with errors that say what to install.

The package must import on a machine with no GPU, no cupy and no mpi4py (the CPU
tests and the gloo reference path need nothing else), so every such module is
imported through :func:`require` at the point of use, never at module top level.
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

__all__ = ["require", "cuda_extra"]

# An extra name, or several separated by commas ("cu12,cu13" is not an extra but
# reads naturally in a hint, so it is split below).
_EXTRA_RE = re.compile(r"^[A-Za-z0-9_\-]+(\s*[|,/]\s*[A-Za-z0-9_\-]+)*$")


def cuda_extra() -> str:
    """Name the pip extra that matches torch's CUDA build ("cu12" or "cu13").

    Falls back to "cu12|cu13" on a CPU build of torch, where either could be meant.
    """
    try:
        import torch

        cuda = torch.version.cuda
    except Exception:  # torch missing or broken: still give a useful hint
        cuda = None
    if cuda:
        major = cuda.split(".")[0]
        if major in ("12", "13"):
            return f"cu{major}"
    return "cu12|cu13"


def _install_hint(extra_hint: str) -> str:
    if not _EXTRA_RE.match(extra_hint):
        return extra_hint  # already a full sentence or command
    extras = [e for e in re.split(r"\s*[|,/]\s*", extra_hint) if e]
    return " or ".join(f"pip install 'overlap[{e}]'" for e in extras)


def require(module_name: str, extra_hint: str, *, purpose: str | None = None) -> ModuleType:
    """Import ``module_name`` or raise an ``ImportError`` that names the fix.

    ``extra_hint`` is the pip extra that provides the module ("cu13", "mpi",
    "cu12|cu13"), or a full hint sentence used as is. ``purpose`` says what the module
    is for, e.g. "the NCCL communicator"; the message then reads
    "cupy is needed for the NCCL communicator: pip install 'overlap[cu13]'".

    A module that is installed but fails to load (e.g. cupy without a CUDA driver)
    raises the same way, chaining the original error, because the fix is the same
    kind of thing: the CUDA-side install.
    """
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        top = module_name.split(".")[0]
        what = f"{top} is needed for {purpose}" if purpose else f"{top} is needed"
        detail = "" if isinstance(exc, ModuleNotFoundError) and exc.name == top else f" ({exc})"
        raise ImportError(f"{what}: {_install_hint(extra_hint)}{detail}", name=module_name) from exc
