"""The one error users see for bad strategies and unsupported programs."""
from __future__ import annotations

from typing import Optional


class ShardingError(ValueError):
    """A strategy or program shardprop cannot honour. The message names the
    operator, its source line, the shapes and the strategy, and says what to do."""


def sharding_error(problem: str, *, operator: str, source: Optional[str] = None, shapes=None,
                   strategy=None, fix: str = "") -> ShardingError:
    lines = [f"{operator}" + (f" at {source}" if source else "") + f": {problem}"]
    if shapes is not None:
        lines.append(f"  shapes:   {_fmt(shapes)}")
    if strategy is not None:
        lines.append(f"  strategy: {_fmt(strategy)}")
    if fix:
        lines.append(f"  fix:      {fix}")
    return ShardingError("\n".join(lines))


def _fmt(x) -> str:
    if type(x) is tuple and x and all(isinstance(s, tuple) for s in x):
        inner = ", ".join(_fmt(s) for s in x)
        return f"({inner},)" if len(x) == 1 else f"({inner})"
    return str(x)
