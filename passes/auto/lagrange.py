"""The memory limit by Lagrange multipliers: a fast way to a plan that fits, with a
proven bound on how far from the best one it can be.

An exact memory row (``sum bytes x <= limit``) couples every decision it counts, so
with rows present the exact DP cannot eliminate anything and HiGHS solves the full
MILP (tens of seconds where the unlimited problem takes a fraction of one). Here each
row ``r`` is moved into the objective at a price ``lam[r]`` seconds per byte:

    min  time(x) + sum_r lam[r] * (bytes_r(x) - limit)

which is an unlimited problem again (row terms on one decision go to its own costs, a
copy between two decisions to an edge between them), solved by the same DP + HiGHS.
For any ``lam >= 0`` its optimum is a lower bound on the best plan that fits (every
plan that fits pays at most its own time there), and each plan it returns that fits
is an upper bound. The prices: raised fourfold on the rows a plan overflows, from a
first guess, while no plan fits; then, with a plan that fits, the prices that maximize the lower bound the plans
seen so far allow (Kelley's cutting planes: one line per plan, a small LP). It stops
when the two bounds are within ``tolerance``, or when the bound can rise no further
(what gap is left is the relaxation's own: an integer problem's dual can stay below
its optimum); the caller falls back to the exact rows where the gap is above
``tolerance``. Rows are added as in the exact search: where a plan peaks over the
limit at a program point no row holds yet.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from ...ir.errors import ShardingError
from . import milp


@dataclass
class Outcome:
    choice: Optional[dict]        # the best plan that fits (problem numbering), or None
    objective: float              # its modeled time (inf if none)
    bound: float                  # the best lower bound on any plan that fits
    rows: list                    # the memory rows met on the way (for an exact solve after)
    iterations: int
    seconds: float
    smallest: Optional[tuple] = None   # (peak, choice) of the smallest-peak plan met
    variables: int = 0                 # the last relaxed MILP's size
    binaries: int = 0
    history: list = field(default_factory=list)   # (lower bound, objective or None, peak) per iteration

    @property
    def gap(self) -> float:
        if self.choice is None:
            return float("inf")
        return max(0.0, (self.objective - self.bound) / self.objective) if self.objective > 0 else 0.0


def price_rows(red: milp.Reduced, rows: list, lam: np.ndarray) -> milp.Reduced:
    """``red`` with each row's bytes priced at ``lam`` seconds per byte in the
    objective (the constant ``-lam * limit`` is left to the caller)."""
    from .problem import Edge
    unary = {t: u.copy() for t, u in red.unary.items()}
    pairs: dict = {}
    for row, price in zip(rows, lam):
        if price <= 0:
            continue
        for t, vec in row.nodes.items():
            unary[t] += price * vec[red.kept[t]]
        for a, b, rows_a, cols_b, nbytes in row.pairs:
            key = (a, b, id(rows_a), id(cols_b))   # one copy term is shared by every row that holds it
            if key in pairs:
                pairs[key][2] = pairs[key][2] + price * nbytes
            else:
                pairs[key] = [rows_a, cols_b, price * nbytes]
    edges = list(red.edges)
    for (a, b, _, _), (rows_a, cols_b, cost) in pairs.items():
        ra, rmap = milp._compact(rows_a[red.kept[a]])
        cb, cmap = milp._compact(cols_b[red.kept[b]])
        edges.append(Edge(a, b, ra, cb, cost[np.ix_(rmap, cmap)]))
    return milp.Reduced(unary, edges, red.kept, red.memory, red.tie)


def row_bytes(row: milp.MemoryRow, choice: dict) -> float:
    """Bytes a plan (problem numbering) holds at the row's program point."""
    total = sum(float(vec[choice[t]]) for t, vec in row.nodes.items())
    total += sum(float(nbytes[rows_a[choice[a]], cols_b[choice[b]]]) for a, b, rows_a, cols_b, nbytes in row.pairs)
    return total


def search(red: milp.Reduced, objective: Callable[[dict], float], peak: Callable[[dict], tuple],
           row_at: Callable[[int], milp.MemoryRow], limit: float, tolerance: float = 0.01,
           max_iterations: int = 30, time_limit: Optional[float] = None, rows: tuple = ()) -> Outcome:
    """The multiplier search. ``objective(choice)``: a plan's modeled time; ``peak(choice)``:
    (its modeled peak, the program point of it); ``row_at(point)``: the exact row there;
    ``rows``: rows to start from (``Outcome.rows`` holds them, then those met)."""
    t0 = time.perf_counter()
    rows = list(rows)
    points: list = [r.point for r in rows]
    lam = np.zeros(len(rows))
    seen: list = []          # every relaxed plan: (choice, its time); each is a cut of the dual
    excess = np.zeros((0, len(rows)))   # per seen plan, per row: its bytes there less the limit
    best, best_time = None, float("inf")
    bound = -float("inf")
    smallest = None
    history = []
    scale = None
    it = variables = binaries = 0
    for it in range(1, max_iterations + 1):
        try:
            sol = milp.solve(price_rows(red, rows, lam), time_limit=_left(time_limit, t0))
        except ShardingError:   # (its time limit before any plan: what was met so far; a brief call
            break               # of 1 s ran out on the 8-device GPT step at load 10 and sank the search)
        if not sol.choice:   # (an unlimited problem always has a plan; a time limit can leave none)
            break
        choice = sol.choice
        variables, binaries = sol.variables, sol.binaries
        bound = max(bound, sol.bound - float(lam.sum()) * float(limit))
        time_of = objective(choice)
        scale = scale or max(time_of, 1e-12)
        p, at = peak(choice)
        if smallest is None or p < smallest[0]:
            smallest = (p, choice)
        fits = p <= limit
        history.append((bound, time_of if fits else None, p))
        if fits and time_of < best_time:
            best, best_time = choice, time_of
        if best is not None and best_time - bound <= tolerance * best_time:
            break
        if best is not None and time_limit is not None and time.perf_counter() - t0 > time_limit:
            break   # (out of time with a plan that fits: it, with the gap so far)
        if not fits and at not in points:   # the plan peaks where no row holds it yet
            points.append(at)
            rows.append(row_at(at))
            lam = np.append(lam, 0.0)
            excess = np.hstack([excess, np.array([[row_bytes(rows[-1], c) - limit] for c, _ in seen]).reshape(-1, 1)])
        seen.append((choice, time_of))
        excess = np.vstack([excess, [[row_bytes(r, choice) - limit for r in rows]]])
        if best is None:
            if len(history) > 4 and smallest[0] < min(h[2] for h in history[-4:]):
                break   # four raises moved no plan below the smallest peak: the prices cannot make one fit
            # no plan fits yet: raise the prices of the rows it overflows, from a first price
            # that weighs the overflow like the unlimited plan's whole step, fourfold each time
            over = excess[-1] > 0
            lam = np.where(over, np.where(lam > 0, 4 * lam, scale / np.maximum(excess[-1], 1.0)), lam)
            if time_limit is not None and time.perf_counter() - t0 > time_limit:
                break   # (without it, a brief call of 1 s that met no plan that fits ran its 30 solves: 20 s)
            continue
        cap = 4 * float(lam.max()) + scale / float(limit)
        nxt, model_max = _kelley(np.array([t for _, t in seen]), excess, scale, float(limit), cap)
        if model_max - bound <= tolerance * max(abs(bound), scale) * 0.1:
            break   # the dual is at its maximum: what gap is left is the relaxation's own
        lam = nxt
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            break
    return Outcome(best, best_time, bound, rows, it, time.perf_counter() - t0, smallest, history=history,
                   variables=variables, binaries=binaries)


def _kelley(times: np.ndarray, excess: np.ndarray, scale: float, limit: float, cap: float) -> tuple[np.ndarray, float]:
    """The next prices (seconds per byte, per row) and the dual's upper model there:
    the dual is the lower envelope of one line per plan seen (its time plus the prices
    times its excess bytes); the prices that maximize that envelope (Kelley's cutting
    planes; a small LP, scaled to O(1)); prices at most ``cap``."""
    from scipy.optimize import linprog
    k, m = excess.shape
    if m == 0:
        return np.zeros(0), float(times.min())
    # variables: z (seconds / scale), then the prices (per row, seconds/byte * limit / scale)
    a = np.hstack([np.ones((k, 1)), -excess / limit])
    res = linprog(np.r_[-1.0, np.zeros(m)], A_ub=a, b_ub=times / scale,
                  bounds=[(None, None)] + [(0.0, cap * limit / scale)] * m, method="highs")
    if res.x is None:   # pragma: no cover (the box keeps it bounded and feasible)
        return np.zeros(m), float("inf")
    return res.x[1:] * scale / limit, -float(res.fun) * scale


def _left(time_limit, t0):
    return None if time_limit is None else max(1.0, time_limit - (time.perf_counter() - t0))
