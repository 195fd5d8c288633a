"""Which line of the user's program a call or an equation comes from.

``caller_source()`` names the innermost frame outside shardprop and jax (a ``shard()``
call, ``parallelize``); ``SourceLine`` does the same, when first asked, for an
equation jax traced (``Op.source``). Both skip library frames: shardprop's own
folders, jax and jaxlib, contextlib and functools.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Optional

# the repository's folders that install as shardprop.compiler, .ir, .passes, .runtime
# (pyproject.toml's package-dir): frames from them are shardprop's, not the user's
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN_DIRS = tuple(os.path.join(_ROOT, d) + os.sep for d in ("compiler", "ir", "passes", "runtime", "shardprop"))


@functools.lru_cache(maxsize=4096)
def is_library_frame(path: str) -> bool:
    path = os.path.abspath(path)
    if path.startswith(_OWN_DIRS):
        return True
    parts = path.split(os.sep)
    return "jax" in parts or "jaxlib" in parts or path.endswith(("contextlib.py", "functools.py"))


@functools.lru_cache(maxsize=4096)
def _is_library_code(code) -> bool:
    """Per code object (one per function), so a frame's path is looked at once."""
    return is_library_frame(code.co_filename)


def caller_source() -> str:
    """``file.py:LINE`` of the innermost frame outside shardprop and jax."""
    frame = sys._getframe(1)
    while frame is not None:
        if not is_library_frame(frame.f_code.co_filename):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def source_of(source_info) -> Optional[str]:
    """``file.py:LINE`` of the innermost user frame of a jax equation's traceback."""
    tb = getattr(source_info, "traceback", None)
    if tb is None:
        return None
    raw = getattr(tb, "raw_frames", None)
    if raw is None:   # a jaxlib without raw frames
        for fr in tb.frames:
            if not is_library_frame(fr.file_name):
                return f"{os.path.basename(fr.file_name)}:{fr.line_num}"
        return None
    # raw frames are ten times cheaper than .frames; the line is looked up only
    # for the one frame that is wanted
    for code, lasti in zip(*raw()):
        if not _is_library_code(code):
            return f"{os.path.basename(code.co_filename)}:{type(tb).code_addr2line(code, lasti)}"
    return None


class SourceLine:
    """An equation's ``file.py:LINE``, found when first asked for (``Op.source``).
    Bodies traced inside library code (jax.nn.relu's custom_jvp) carry no user
    frame of their own: they take the line of the call that holds them."""
    __slots__ = ("info", "outer")

    def __init__(self, info, outer):
        self.info, self.outer = info, outer

    def __call__(self) -> Optional[str]:
        found = source_of(self.info)
        if found is None and self.outer is not None:
            found = self.outer if isinstance(self.outer, str) else self.outer()
        return found
