"""Repeated layers in a program: runs of ops that repeat the same block back to back.

A model built with a Python loop over layers traces into the same ops again and
again (forward, and again in the backward). Each op is given a token (equal ops,
equal token: same primitive, source line, layouts, shapes); a repeated layer is
then a tandem repeat of the token sequence. The report shows each such run as one
block with its repeat count.

    find_repeats([1, 2, 3, 1, 2, 3, 1, 2, 3, 9])  ->  [Repeat(start=0, period=3, count=3, inner=[])]
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

_PERIODS_TRIED = 24   # most frequent distances between equal tokens; the true period is among them


@dataclass
class Repeat:
    start: int          # position of the first op of the first repetition
    period: int         # ops per repetition
    count: int          # repetitions (>= 2)
    inner: list = field(default_factory=list)   # repeats inside one repetition, positions relative to start

    def to_json(self) -> dict:
        out = {"start": self.start, "period": self.period, "count": self.count}
        if self.inner:
            out["inner"] = [r.to_json() for r in self.inner]
        return out


def find_repeats(tokens: list, min_saved: int = 4) -> list[Repeat]:
    """Non-overlapping tandem repeats of ``tokens``, in order, each as large as
    greedily possible (the run that saves the most rows first, then what is left on
    either side and inside one repetition). Runs that would hide fewer than
    ``min_saved`` ops are not worth a block."""
    out: list[Repeat] = []
    _search(tokens, 0, len(tokens), min_saved, out)
    out.sort(key=lambda r: r.start)
    return out


def _search(tokens: list, lo: int, hi: int, min_saved: int, out: list) -> None:
    best = _best_run(tokens, lo, hi)
    if best is None or best[1] * (best[2] - 1) < min_saved:
        return
    start, period, count = best
    inner: list[Repeat] = []
    _search(tokens, start, start + period, min_saved, inner)
    for r in inner:
        r.start -= start
    inner.sort(key=lambda r: r.start)
    out.append(Repeat(start, period, count, inner))
    _search(tokens, lo, start, min_saved, out)
    _search(tokens, start + period * count, hi, min_saved, out)


def _best_run(tokens: list, lo: int, hi: int):
    """(start, period, count) of the periodic run in tokens[lo:hi] that hides the most ops."""
    if hi - lo < 4:
        return None
    last: dict = {}
    distances: Counter = Counter()
    for i in range(lo, hi):
        t = tokens[i]
        j = last.get(t)
        if j is not None:
            distances[i - j] += 1
        last[t] = i
    best, best_saved = None, 0
    for period, _ in distances.most_common(_PERIODS_TRIED):
        if 2 * period > hi - lo:
            continue
        j = lo
        end = hi - period
        while j < end:
            if tokens[j] != tokens[j + period]:
                j += 1
                continue
            a = j
            while j < end and tokens[j] == tokens[j + period]:
                j += 1
            # tokens[a : j + period] repeats with this period
            count = (j - a + period) // period
            saved = period * (count - 1)
            if count >= 2 and saved > best_saved:
                best, best_saved = (a, period, count), saved
    return best
