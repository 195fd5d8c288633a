"""Bounded staleness. A server's version counts the updates it applied; a push
carries the version its gradient was computed from. The gap is the push's
staleness: up to ``max_staleness`` it is applied, beyond it the push is refused
and the worker that sent it pulls fresh parameters before its next step (the
lagging worker waits for fresh state; nobody waits for the lagging worker)."""
from __future__ import annotations

from collections import Counter
from typing import Optional


class StalenessBook:
    def __init__(self, max_staleness: Optional[int]):
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: need 0 or more (0 = only fresh gradients), "
                             "or None for no bound")
        self.max_staleness = max_staleness
        self.applied = Counter()     # staleness -> pushes applied
        self.refused = 0

    def admit(self, version_now: int, base_version: int) -> tuple[bool, int]:
        gap = version_now - base_version
        if self.max_staleness is not None and gap > self.max_staleness:
            self.refused += 1
            return False, gap
        self.applied[gap] += 1
        return True, gap

    def summary(self) -> dict:
        n = sum(self.applied.values())
        mean = sum(g * c for g, c in self.applied.items()) / n if n else 0.0
        return {"applied": n, "refused": self.refused, "max": max(self.applied, default=0), "mean": mean,
                "bound": self.max_staleness, "histogram": dict(sorted(self.applied.items()))}


def merge(summaries: list[dict]) -> dict:
    """One report over several servers' books."""
    hist = Counter()
    refused = 0
    for s in summaries:
        hist.update(s["histogram"])
        refused += s["refused"]
    n = sum(hist.values())
    return {"applied": n, "refused": refused, "max": max(hist, default=0),
            "mean": sum(g * c for g, c in hist.items()) / n if n else 0.0,
            "bound": summaries[0]["bound"] if summaries else None, "histogram": dict(sorted(hist.items()))}
