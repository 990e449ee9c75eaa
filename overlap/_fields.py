"""Type and range checks of the config dataclasses' fields, at construction.

Every config field is checked for its type first (a bool is not an int, a string is not
a number, nan and inf are not numbers here), then for its range, and the error names
the class and the field: ``OverlapConfig.chunks must be an int in [1, 64], got '4'``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["int_field", "float_field", "bool_field", "choice_field"]


def _show(v: Any) -> str:
    return repr(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else f"{v!r} ({type(v).__name__})"


def int_field(owner: str, name: str, v: Any, lo: int, hi: int, *, none_ok: bool = False) -> None:
    """``v`` an int (not a bool) in [lo, hi], or None where ``none_ok``."""
    if v is None and none_ok:
        return
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):  # numpy's ints too
        raise TypeError(f"{owner}.{name} must be an int in [{lo}, {hi}]{' or None' if none_ok else ''}, "
                        f"got {_show(v)}")
    if not lo <= v <= hi:
        raise ValueError(f"{owner}.{name} must be in [{lo}, {hi}], got {v}")


def float_field(owner: str, name: str, v: Any, lo: float, hi: float, *, none_ok: bool = False) -> None:
    """``v`` a finite real number (an int or a float, not a bool) in [lo, hi], or None."""
    if v is None and none_ok:
        return
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{owner}.{name} must be a number in [{lo:g}, {hi:g}]{' or None' if none_ok else ''}, "
                        f"got {_show(v)}")
    if not math.isfinite(v) or not lo <= v <= hi:
        raise ValueError(f"{owner}.{name} must be a finite number in [{lo:g}, {hi:g}], got {v}")


def bool_field(owner: str, name: str, v: Any) -> None:
    """``v`` True or False (not 1, not 'no')."""
    if not isinstance(v, bool):
        raise TypeError(f"{owner}.{name} must be True or False, got {_show(v)}")


def choice_field(owner: str, name: str, v: Any, choices: tuple[Any, ...]) -> None:
    """``v`` one of ``choices``."""
    if not isinstance(v, type(choices[0])) or v not in choices:
        raise ValueError(f"{owner}.{name} must be one of {', '.join(map(repr, choices))}, got {_show(v)}")
