"""How the choice is made: the search problem as a mixed-integer linear program,
solved by HiGHS through ``scipy.optimize.milp``.

Variables: ``x[t, k]`` (binary) picks candidate ``k`` of template node ``t``, one
per node; ``y[e, i, j]`` (continuous in [0, 1]) is the pair of candidates an
edge's two nodes take. The standard linearization ties them: for every edge,
``sum_j y[e, i, j] = x[a, i]`` and ``sum_i y[e, i, j] = x[b, j]``; with one-hot
``x`` that leaves exactly ``y[e, i, j] = x[a, i] x[b, j]``. Objective: unary
costs on ``x`` plus edge costs on ``y``. Memory: ``sum coef x <= limit`` per
program point given (``search.py`` adds the points a plan overflows at).

Before the solve, two exact reductions: an edge whose cost splits into a part
per side (``a_i + b_j``) is folded into the nodes' own costs, and a candidate
that another one beats or ties on every cost and every byte is dropped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ...ir.errors import ShardingError

from ..cost import IMPOSSIBLE
from .eliminate import back_substitute, eliminate


TIE_BREAK_S_PER_BYTE = 1e-16   # far below any real cost: only decides between otherwise equal plans


@dataclass
class Reduced:
    unary: dict                      # template -> seconds per kept candidate
    edges: list                      # Edge (problem.py) over the kept candidates
    kept: dict                       # template -> original indices of the kept candidates
    memory: dict = field(default_factory=dict)   # template -> list of bytes vectors (kept candidates)
    tie: float = 0.0    # the most the tie-break can add to a plan's objective (a solver's bound less it bounds the time)


@dataclass
class MemoryRow:
    """Bytes per device alive at one program point, held to the limit: per template,
    bytes per candidate (the values alive there, copies made within one decision),
    and per pair of decisions a copy between them makes (``(a, b, rows, cols,
    bytes)``: candidate i of ``a`` makes class ``rows[i]``, candidate j of ``b``
    needs class ``cols[j]``, the copy holds ``bytes[rows[i], cols[j]]``); candidates
    in the problem's numbering."""
    nodes: dict
    pairs: list = field(default_factory=list)
    point: Optional[int] = None      # the program point it counts (the same row in a search run again)


@dataclass
class Solution:
    choice: dict                     # template -> candidate index (in the problem's numbering)
    objective: float                 # modeled step time of the choice (seconds)
    bound: float                     # the solver's lower bound on any plan's time
    gap: float                       # relative gap between the two (0 when proven optimal)
    status: str
    seconds: float
    variables: int
    binaries: int


def reduce(problem, memory_matters: bool, upper: Optional[float] = None,
           allowed: Optional[dict] = None, also: tuple = ()) -> Reduced:
    """Fold separable edges into node costs, then drop dominated candidates, and, given
    the time of some plan that fits (``upper``), every candidate that no plan taking it
    can beat that with (a lower bound on each: its own cost, the cheapest side of each
    of its edges, the cheapest of every other node). ``allowed``: template -> the
    candidate indices it may take (a hand plan's storage layouts, ``hand.py``);
    dominance is then judged among those alone. ``also``: more such narrowings, whose
    own undominated candidates are kept too, so that one reduced problem (one model,
    ``warm_lp.py``) serves each of them narrowed by bounds."""
    from .problem import Edge
    unary = {t: u.copy() for t, u in problem.unary.items()}
    # ties (a free slice of an argument fed whole) go to the plan that holds fewer bytes
    tie = 0.0
    for t, vec in problem.values.values():
        unary[t] += vec * TIE_BREAK_S_PER_BYTE
        tie += float(vec.max(initial=0.0)) * TIE_BREAK_S_PER_BYTE
    edges = []
    for e in problem.edges:
        m = e.cost
        if not np.any(m):
            continue
        if np.allclose(m, m[:, :1] + m[:1, :] - m[0, 0], rtol=0, atol=1e-15):
            unary[e.a] += (m[:, 0] - m[0, 0])[e.rows]
            unary[e.b] += m[0, :][e.cols]
            continue
        edges.append(e)
    memory: dict = {}
    if memory_matters:
        for t, vec in problem.values.values():
            memory.setdefault(t, {})[vec.tobytes()] = vec   # equal vectors compare alike
    allowed = allowed or {}
    kept = {t: _undominated(t, unary, edges, memory.get(t, {}), allowed.get(t)) for t in unary}
    for narrowing in also:
        for t, among in narrowing.items():
            kept[t] = np.union1d(kept[t], _undominated(t, unary, edges, memory.get(t, {}), among))
    if upper is not None:
        kept = _bounded(unary, edges, kept, upper)
    out = []
    for e in edges:
        rows, rmap = _compact(e.rows[kept[e.a]])
        cols, cmap = _compact(e.cols[kept[e.b]])
        out.append(Edge(e.a, e.b, rows, cols, e.cost[np.ix_(rmap, cmap)]))
    return Reduced({t: unary[t][kept[t]] for t in unary}, out, kept,
                   {t: [v[kept[t]] for v in vs.values()] for t, vs in memory.items()}, tie)


def _bounded(unary: dict, edges: list, kept: dict, upper: float) -> dict:
    lower = {t: unary[t].copy() for t in unary}
    for e in edges:   # each edge counted once, at its first node, at its cheapest partner
        lower[e.a] += e.cost[:, np.unique(e.cols[kept[e.b]])].min(axis=1)[e.rows]
    floor = {t: lower[t][kept[t]].min() for t in lower}
    total = sum(floor.values())
    slack = upper * (1 + 1e-9) + 1e-15
    out = {}
    for t, k in kept.items():
        keep = k[total - floor[t] + lower[t][k] <= slack]
        out[t] = keep if len(keep) else k
    return out


@dataclass
class _CopyEdge:
    """Pair variables for a copy a memory row counts (no cost of its own)."""
    a: int
    b: int
    rows: np.ndarray
    cols: np.ndarray
    cost: np.ndarray


def _compact(classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Renumber the classes that occur 0..n-1: (new class per candidate, old class per new)."""
    old, new = np.unique(classes, return_inverse=True)
    return new.reshape(-1), old


def _undominated(t: int, unary: dict, edges: list, memory: dict, among=None) -> np.ndarray:
    """Candidates of ``t`` that no other candidate beats or ties on every cost (its own,
    each edge's against every neighbour candidate) and every value's bytes; ``among``:
    only those candidates (indices) are considered."""
    cols = [unary[t][:, None]]
    for e in edges:
        if e.a == t:
            cols.append(e.cost[e.rows])
        elif e.b == t:
            cols.append(e.cost[:, e.cols].T)
    cols += [v[:, None] for v in memory.values()]
    feats = np.hstack(cols)
    idx = np.arange(feats.shape[0]) if among is None else np.asarray(among, dtype=int)
    feats = feats[idx]
    k = feats.shape[0]
    if k == 1:
        return idx
    possible = np.abs(feats[feats < IMPOSSIBLE])
    tol = 1e-12 * max(1.0, float(possible.max(initial=0.0)))   # (an impossible move's price would swamp it)
    le = np.all(feats[:, None, :] <= feats[None, :, :] + tol, axis=2)   # le[i, j]: i no worse than j anywhere
    # "no worse within tol" is not transitive (a ~ b ~ c while a beats c), so asking of
    # each candidate whether any other beats it can drop them all. Instead walk them from
    # the cheapest in sum (ties by index) and drop one only when a candidate already kept
    # is no worse: every dropped candidate has a kept one at least as good.
    order = sorted(range(k), key=lambda j: (float(feats[j].sum()), j))
    keep = []
    for j in order:
        if not any(le[i, j] for i in keep):
            keep.append(j)
    keep.sort()
    return idx[np.array(keep, dtype=int)]


def solve(red: Reduced, memory_rows: list = (), limit: Optional[float] = None,
          time_limit: Optional[float] = None, rel_gap: float = 1e-9, exact_dp: bool = True,
          relax: bool = False, lp_first: Optional[bool] = None) -> Solution:
    """Solve the reduced problem; ``memory_rows``: ``MemoryRow``s, each held to ``limit``
    (a copy between two decisions gets pair variables of its own, tied like an edge's).
    ``relax``: solve the LP relaxation only (``bound``: its optimum, a lower bound on
    every plan that meets the rows) and round it, each decision to its largest
    candidate (``choice``, not priced: the caller prices it and checks its peak;
    ``rounded``: whether the LP was fractional anywhere; ``support``: per decision the
    LP solved, the candidates it weighs and their weights; ``complete(rounding)``: a
    whole plan from one candidate per such decision). A decision a memory row
    counts is never eliminated (the row needs its variables).
    Without memory rows, ``exact_dp`` first eliminates the decisions with at most two
    neighbours (``eliminate.py``) and the LP relaxation is tried first: where its
    optimum is integral it is the MILP's, proven (the usual case here); ``lp_first=False``
    skips that try (the caller knows the LP is fractional)."""
    try:
        from scipy.optimize import LinearConstraint, milp  # noqa: F401
    except ImportError as e:   # pragma: no cover (tested by hiding scipy)
        raise ShardingError(f"mode='auto' needs the HiGHS solver through scipy.optimize.milp, which cannot be "
                            f"imported ({e}); install it with `pip install 'scipy>=1.9'` (or use "
                            f"mode='sharding_propagation')") from None
    t0 = time.perf_counter()
    from .problem import Edge
    unary, edges, steps, offset = red.unary, list(red.edges), [], 0.0
    if exact_dp:   # (a decision a memory row counts keeps its variables)
        counted = {t for row in memory_rows for t in row.nodes} | \
            {t for row in memory_rows for a, b, *_ in row.pairs for t in (a, b)}
        unary, edges, steps, offset = eliminate(red.unary, red.edges, Edge, keep=counted)
    if unary:
        sol = _milp(unary, edges, red.kept, memory_rows, limit, time_limit, rel_gap,
                    lp_first=not memory_rows if lp_first is None else lp_first, relax=relax)
    else:   # the DP solved all of it
        sol = Solution({}, 0.0, 0.0, 0.0, "Optimal (solved exactly by elimination)", 0.0, 0, 0)
    if relax and getattr(sol, "fractions", None) is not None:
        # what the LP weighs, per decision it solved (the problem's numbering), and a
        # way back to a whole plan from a rounding of those (the eliminated decisions
        # take their best answer to it)
        sol.support = {t: (red.kept[t][w > 1e-7], w[w > 1e-7]) for t, w in sol.fractions.items()}
        pos = {t: {int(k): i for i, k in enumerate(red.kept[t])} for t in sol.fractions}

        def complete(rounded: dict) -> dict:
            local = back_substitute(steps, {t: pos[t][k] for t, k in rounded.items()})
            return {t: int(red.kept[t][k]) for t, k in local.items()}
        sol.complete = complete
    if sol.choice or not unary:
        local = back_substitute(steps, sol.choice)
        sol.choice = {t: int(red.kept[t][k]) for t, k in local.items()}
        sol.objective += offset
        sol.bound += offset - red.tie   # (the solver's bound counts the tie-break; the plan's time does not)
        if steps:
            sol.status += f"; {len(steps)} of {len(red.unary)} decisions eliminated exactly first"
    sol.seconds = time.perf_counter() - t0
    return sol


def _milp(unary: dict, edges: list, kept: dict, memory_rows, limit, time_limit, rel_gap,
          lp_first: bool, relax: bool = False) -> Solution:
    """The MILP over what is left; the choice in kept numbering ({} if infeasible)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix
    t0 = time.perf_counter()
    temps = sorted(unary)
    xoff, n = {}, 0
    for t in temps:
        xoff[t] = n
        n += len(unary[t])
    nx = n
    copies = []   # per memory row: [(edge index, bytes by kept class)]
    for row in memory_rows:
        copies.append([])
        for a, b, rows_a, cols_b, nbytes in row.pairs:
            ra, rmap = _compact(rows_a[kept[a]])
            cb, cmap = _compact(cols_b[kept[b]])
            copies[-1].append((len(edges), nbytes[np.ix_(rmap, cmap)]))
            edges.append(_CopyEdge(a, b, ra, cb, np.zeros((len(rmap), len(cmap)))))
    eoff = []
    for e in edges:
        eoff.append(n)
        n += e.cost.size
    c = np.zeros(n)
    for t in temps:
        c[xoff[t]:xoff[t] + len(unary[t])] = unary[t]
    for e, base in zip(edges, eoff):
        c[base:base + e.cost.size] = e.cost.ravel()
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0
    for t in temps:                       # one candidate per node
        k = len(unary[t])
        rows += [r] * k
        cols += range(xoff[t], xoff[t] + k)
        vals += [1.0] * k
        lo.append(1.0)
        hi.append(1.0)
        r += 1
    for e, base in zip(edges, eoff):  # y's marginals are the x's, summed over each layout class
        ka, kb = e.cost.shape
        for i in range(ka):
            members = np.nonzero(e.rows == i)[0]
            rows += [r] * (kb + len(members))
            cols += [base + i * kb + j for j in range(kb)] + [xoff[e.a] + int(k) for k in members]
            vals += [1.0] * kb + [-1.0] * len(members)
            lo.append(0.0)
            hi.append(0.0)
            r += 1
        for j in range(kb):
            members = np.nonzero(e.cols == j)[0]
            rows += [r] * (ka + len(members))
            cols += [base + i * kb + j for i in range(ka)] + [xoff[e.b] + int(k) for k in members]
            vals += [1.0] * ka + [-1.0] * len(members)
            lo.append(0.0)
            hi.append(0.0)
            r += 1
    for row, row_copies in zip(memory_rows, copies):   # in units of the limit (HiGHS wants rows near 1)
        for t, vec in row.nodes.items():
            vec = vec[kept[t]]
            rows += [r] * len(vec)
            cols += range(xoff[t], xoff[t] + len(vec))
            vals += list(vec / float(limit))
        for ei, nbytes in row_copies:
            rows += [r] * nbytes.size
            cols += range(eoff[ei], eoff[ei] + nbytes.size)
            vals += list(nbytes.ravel() / float(limit))
        lo.append(-np.inf)
        hi.append(1.0)
        r += 1
    A = coo_matrix((vals, (rows, cols)), shape=(r, n)).tocsr()
    integrality = np.zeros(n)
    integrality[:nx] = 1
    options = {"disp": False, "mip_rel_gap": rel_gap}
    if time_limit is not None:
        options["time_limit"] = float(time_limit)
    # an impossible move (making a partial value out of a complete one) is not priced but
    # excluded: its price would dwarf every real one once scaled
    upper = np.ones(n)
    banned = c >= IMPOSSIBLE
    for t in temps:   # a decision with no possible candidate keeps them all, priced
        if banned[xoff[t]:xoff[t] + len(unary[t])].all():
            banned[xoff[t]:xoff[t] + len(unary[t])] = False
    upper[banned] = 0.0
    c = np.where(banned, 0.0, c)
    # seconds are tiny numbers: scaled so that HiGHS's tolerances do not erase the differences
    scale = float(np.abs(c).max()) or 1.0
    constraints = [LinearConstraint(A, lo, hi)]
    bounds = Bounds(np.zeros(n), upper)
    res, how = None, ""
    if relax:
        res = milp(c / scale, integrality=np.zeros(n), bounds=bounds, constraints=constraints, options=options)
        if res.x is None:
            return Solution({}, float("inf"), float("inf"), float("inf"), res.message, time.perf_counter() - t0, n, nx)
        choice = {t: int(np.argmax(res.x[xoff[t]:xoff[t] + len(unary[t])])) for t in temps}
        out = Solution(choice, float(res.fun) * scale, float(res.fun) * scale, 0.0,
                       "LP relaxation with the memory rows, rounded", time.perf_counter() - t0, n, nx)
        out.rounded = bool(np.abs(res.x[:nx] - np.round(res.x[:nx])).max(initial=0.0) >= 1e-7)
        out.fractions = {t: res.x[xoff[t]:xoff[t] + len(unary[t])] for t in temps}
        return out
    if lp_first:
        lp = milp(c / scale, integrality=np.zeros(n), bounds=bounds, constraints=constraints, options=options)
        if lp.x is not None and np.abs(lp.x[:nx] - np.round(lp.x[:nx])).max(initial=0.0) < 1e-7:
            res, how = lp, " (the LP relaxation's optimum is integral)"
        elif time_limit is not None:   # (the time limit is the whole solve's, the LP's seconds included)
            options["time_limit"] = max(float(time_limit) - (time.perf_counter() - t0), 0.05)
    if res is None:
        res = milp(c / scale, integrality=integrality, bounds=bounds, constraints=constraints, options=options)
    seconds = time.perf_counter() - t0
    if res.x is None:
        if res.status == 1:   # the time limit, before any plan was found
            raise ShardingError(f"the strategy search found no plan within its time limit of {time_limit} s "
                                f"({nx} decisions' candidates, {n} variables): {res.message}; mark the big matmuls "
                                "(sp.shard) so that fewer decisions are left to search")
        return Solution({}, float("inf"), float("inf"), float("inf"), res.message, seconds, n, nx)
    x = res.x
    choice = {t: int(np.argmax(x[xoff[t]:xoff[t] + len(unary[t])])) for t in temps}
    bound = float(res.fun) if how else float(getattr(res, "mip_dual_bound", res.fun) or res.fun)
    gap = 0.0 if how else float(getattr(res, "mip_gap", 0.0) or 0.0)
    return Solution(choice, float(res.fun) * scale, bound * scale, gap, res.message + how, seconds, n, nx)
