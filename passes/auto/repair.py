"""A plan over the memory limit made to fit by switching decisions to leaner candidates.

Used for the hand plans (``hand.py``): a family's storage layouts solved for time alone
can hold far more than the plan an engineer writes under that name (tp+FSDP on the
2-layer GPT step on 4 x 2 modeled 4.38 MiB against a 2.42 MiB limit, where the leanest
plan of its layouts holds 2.26 MiB). The search's own LP rounds under memory rows find
such plans too, but a family's took 2-20 s on that step, where this takes a fraction
of a second: what the plan holds at its peak is a sum over decisions, and a switch's
new profile is the last one with that decision's terms summed again
(``search._Liveness.switched``: under a millisecond, a whole profile 22-44 ms at 12
layers).

How: at the point where the plan peaks, every decision that holds bytes there (a value's,
or either end of a copy: a gathered weight) offers the candidate
(within its narrowing) that saves bytes at that point most cheaply, by what the switch
adds to the plan's time (``Problem.switch_deltas``) per byte saved; the cheapest per
byte are switched, as many as cover the excess, and the peak is found again, until the
plan fits. Then each switch the plan no longer needs is undone, the dearest first, and
single switches that make the plan cheaper and keep it under the limit are taken
(``improve``: on that step they took the families' plans from 45 ms to 33-35 ms as
written). The plan is no cheaper than the family's time-optimal one; it is a plan that fits,
not the optimum under the limit.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from ..cost import IMPOSSIBLE

MAX_ROUNDS = 400
# rounds without a lower peak than the least so far after which the plan is given up: its
# switches only move the peak between points (on the 2-layer GPT step on 4 x 2 at half the
# free plan's peak, the families that never fit ran all their 2 s; those that fit took 0.1-0.6 s)
STALL_ROUNDS = 30


def fit_by_switching(problem, memory, limit: float, choice: dict, allowed: Optional[dict] = None,
                     deadline: Optional[float] = None) -> Optional[dict]:
    """``choice`` (template -> candidate) changed until its modeled peak (``memory``: a
    ``search._Liveness``) is at most ``limit``, each decision within ``allowed`` (template
    -> candidate indices; the rest: any): the cheaper of the two ways of taking switches
    (``_take``), each a greedy that the other beat on some GPT step (the careful one fit
    the 2-layer step's LP roundings under half its free peak where the plain one stalled;
    the plain one fit FSDP on the 4-layer step at 46.7 ms as written, the careful at 57.6);
    None where neither fits."""
    first = memory.profile(choice)   # (each switch then sums only its own terms again: ``switched``)
    rows: dict = {}                   # point -> its memory row, for both greedies
    fits = [f for f in (_fit(problem, memory, limit, choice, first, rows, allowed or {}, deadline, careful)
                        for careful in (True, False)) if f is not None]
    # (each switch is priced against the plan before its batch: two taken together, or one
    # undone beside another's switch, can make a move the model excludes, which is no plan)
    return min((f for f in fits if problem.objective(f) < IMPOSSIBLE), key=problem.objective, default=None)


def _fit(problem, memory, limit: float, choice: dict, prof: np.ndarray, rows: dict, allowed: dict,
         deadline: Optional[float], careful: bool) -> Optional[dict]:
    """One greedy of ``fit_by_switching``, from ``choice`` and its profile ``prof``: None where
    no switch saves bytes at the peak, the peak has not come down for ``STALL_ROUNDS``
    rounds, or ``deadline`` (``time.perf_counter()``) passes first."""
    start, choice = dict(choice), dict(choice)
    least, stalled = float("inf"), 0
    for _ in range(MAX_ROUNDS):
        at = int(np.argmax(prof))
        peak = float(prof[at])
        if peak <= limit:
            break
        if deadline is not None and time.perf_counter() >= deadline:
            return None
        least, stalled = (peak, 0) if peak < least else (least, stalled + 1)
        if stalled >= STALL_ROUNDS:
            return None
        row = rows.get(at)
        if row is None:
            row = rows[at] = memory.row(at)
        moves = []
        for t in _deciders(row):
            cands = np.asarray(allowed[t]) if t in allowed else np.arange(len(problem.unary[t]))
            saved = _saved_at(row, choice, t, cands)
            delta = problem.switch_deltas(choice, t)[cands]
            ok = (saved > 0) & (delta < IMPOSSIBLE)
            if not ok.any():
                continue
            per_byte = np.maximum(delta[ok], 0.0) / saved[ok]
            j = int(np.argmin(per_byte))
            moves.append((float(per_byte[j]), t, int(cands[ok][j]), float(saved[ok][j])))
        if not moves:
            return None
        moves.sort()
        choice, prof = _take(memory, choice, prof, moves, at, peak, limit, careful)
    else:
        return None
    # (a batch covers the excess at one point; a later point's may make earlier switches needless)
    undo = [(-float(problem.switch_deltas(choice, t)[start[t]]), t) for t in choice if choice[t] != start[t]]
    for gain, t in sorted(undo, reverse=True):
        if gain <= 0:
            break
        after = memory.switched(choice, prof, t, start[t])
        if after.max() <= limit:
            choice, prof = {**choice, t: start[t]}, after
    return improve(problem, memory, limit, choice, allowed, deadline)


def _take(memory, choice: dict, prof: np.ndarray, moves: list, at: int, peak: float, limit: float,
          careful: bool):
    """(choice, profile) with ``moves`` (per byte, template, candidate, bytes saved at
    ``at``; cheapest first) taken until they cover the excess at ``at``: the cheapest that
    cover it. ``careful``: a switch that saves bytes there by holding more where that passes
    the limit only moves the peak (the switch back is then the cheapest there, and the
    rounds go round until they stall), so the switches that push no point over the limit
    are taken first; where none does, those that keep every point under the peak; where
    none does either, the cheapest that cover it."""
    ceiling = np.maximum(prof, limit)
    careful_ways = (lambda after: not (after > ceiling).any(), lambda after: after.max() <= peak)
    for keeps in careful_ways if careful else ():
        need, taken, out, now = peak - limit, False, dict(choice), prof
        for _, t, k, _ in moves:
            if need <= 0:
                break
            after = memory.switched(out, now, t, k)
            if keeps(after):
                need -= now[at] - after[at]
                out[t], now, taken = k, after, True
        if taken:
            return out, now
    cover = int(np.searchsorted(np.cumsum([m[3] for m in moves]), peak - limit)) + 1
    out = dict(choice)
    for _, t, k, _ in moves[:cover]:
        prof = memory.switched(out, prof, t, k)
        out[t] = k
    return out, prof


def _deciders(row) -> list:
    """The decisions whose candidate changes what one point holds: those of the values
    alive there, and both ends of each copy there (a weight stored split and gathered at
    its use holds the gather's bytes: the copy is what FSDP's peak is made of)."""
    out = dict.fromkeys(row.nodes)
    for a, b, *_ in row.pairs:
        out.setdefault(a)
        out.setdefault(b)
    return list(out)


def _saved_at(row, choice: dict, t: int, cands: np.ndarray) -> np.ndarray:
    """Bytes the point of ``row`` holds less with ``t`` at each of ``cands`` (the other
    decisions as ``choice`` has them): its values' and every copy it is an end of."""
    saved = np.zeros(len(cands))
    vec = row.nodes.get(t)
    if vec is not None:
        saved += vec[choice[t]] - vec[cands]
    for a, b, rows_a, cols_b, nbytes in row.pairs:
        if a == t:
            col = nbytes[:, cols_b[choice[b]]]
            saved += col[rows_a[choice[a]]] - col[rows_a[cands]]
        elif b == t:
            line = nbytes[rows_a[choice[a]]]
            saved += line[cols_b[choice[b]]] - line[cols_b[cands]]
    return saved


def improve(problem, memory, limit: float, choice: dict, allowed: Optional[dict] = None,
            deadline: Optional[float] = None) -> dict:
    """``choice`` (which fits ``limit``) with single switches that make it cheaper and keep
    it under the limit, the largest gain first, until none is left or ``deadline``."""
    allowed = allowed or {}
    choice = dict(choice)
    prof = memory.profile(choice)
    while deadline is None or time.perf_counter() < deadline:
        gains = []
        for t in problem.unary:
            d = problem.switch_deltas(choice, t)
            cands = np.asarray(allowed[t]) if t in allowed else np.arange(len(d))
            j = int(np.argmin(d[cands]))
            if d[cands][j] < -1e-15:
                gains.append((float(d[cands][j]), t, int(cands[j])))
        better = False
        for _, t, k in sorted(gains):
            if deadline is not None and time.perf_counter() >= deadline:
                break
            if problem.switch_deltas(choice, t)[k] >= -1e-15:   # (a switch before it took this gain)
                continue
            after = memory.switched(choice, prof, t, k)
            if after.max() <= limit:
                choice, prof, better = {**choice, t: k}, after, True
        if not better:
            break
    return choice
