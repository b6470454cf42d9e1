"""An exception as a user reads it: its message's first line, stripped (tracebacks and chained dumps aside).

build-repo copies this file beside the backends' model.py, so it must stay self-contained.
"""
from __future__ import annotations


def first_line(exc: BaseException, empty: str = "") -> str:
    """The first line of `exc`'s message; `empty` where it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else empty
