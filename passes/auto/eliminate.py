"""Exact dynamic programming before the solver: decisions with at most two
neighbours are eliminated (variable elimination, the DP over a chain).

A decision ``t`` whose edges reach one other decision ``x`` adds to each candidate
of ``x`` the cheapest way ``t`` can answer it (``min_k unary[t][k] + edges(k, .)``);
one whose edges reach two, ``a`` and ``b``, becomes one edge between them holding,
per pair of their candidates, the cheapest candidate of ``t`` in between (only
where that edge has no more pair variables than the edges it replaces: between two
decisions with many candidates it would grow the MILP instead). A chain
of layers folds up to a single decision this way, a tree to nothing, and what is
left (the decisions many others read: a shared weight, the residual stream) goes
to the MILP, smaller. Afterwards each eliminated decision takes its cheapest
candidate given its neighbours' choices, in reverse order: the same optimum as
the full MILP's. Only without memory rows: a row sums bytes over decisions, which
this does not carry.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Eliminated:
    """One eliminated decision: its cost per candidate when it was eliminated, and per
    neighbour the summed edge costs (its candidates x the neighbour's)."""
    t: int
    unary: np.ndarray
    toward: list   # [(neighbour, matrix K x neighbour's candidates)]


def eliminate(unary: dict, edges: list, edge_type, keep=frozenset()) -> tuple[dict, list, list, float]:
    """(unary, edges, steps, offset) of the problem left after eliminating every decision
    with at most two neighbours (or one candidate); ``offset``: the cost of what was
    eliminated with nothing left to charge it to. ``edge_type(a, b, rows, cols, cost)``
    makes an edge. ``keep``: decisions never eliminated (those a memory row counts: the
    row needs their variables). ``unary`` and ``edges`` are not modified."""
    unary = {t: u.copy() for t, u in unary.items()}
    live = dict(enumerate(edges))
    at: dict = {t: set() for t in unary}
    for i, e in live.items():
        at[e.a].add(i)
        at[e.b].add(i)
    steps: list = []
    offset = 0.0
    queue = list(unary)
    while queue:
        t = queue.pop()
        if t not in at or t in keep:
            continue
        ids = at[t]
        near = {live[i].b if live[i].a == t else live[i].a for i in ids}
        if len(near) > 2 and len(unary[t]) > 1:
            continue
        k = len(unary[t])
        toward = []
        for x in sorted(near):
            m = np.zeros((k, len(unary[x])))
            for i in ids:
                e = live[i]
                if e.a == t and e.b == x:
                    m += e.cost[np.ix_(e.rows, e.cols)]
                elif e.b == t and e.a == x:
                    m += e.cost[np.ix_(e.rows, e.cols)].T
            toward.append((x, m))
        u = unary[t]
        if len(toward) == 2 and k > 1:
            (a, ma), (b, mb) = toward
            both = (u[:, None, None] + ma[:, :, None] + mb[:, None, :]).min(axis=0)
            rows_u, rows = np.unique(both, axis=0, return_inverse=True)
            cols_u, cols = np.unique(rows_u, axis=1, return_inverse=True)
            # the new edge's pair variables must not outnumber those of the edges it
            # replaces (fill-in between two decisions with many candidates would grow the MILP)
            if cols_u.size > sum(live[i].cost.size for i in ids):
                continue
        del unary[t]
        steps.append(Eliminated(t, u, toward))
        for i in list(ids):
            e = live.pop(i)
            other = e.b if e.a == t else e.a
            at[other].discard(i)
        del at[t]
        if not toward:
            offset += float(u.min())
        elif k == 1:                     # nothing to choose: its costs land on its neighbours
            for n, (x, m) in enumerate(toward):
                unary[x] = unary[x] + m[0] + (u[0] if n == 0 else 0.0)
        elif len(toward) == 1:           # the neighbour pays t's cheapest answer to each of its candidates
            x, m = toward[0]
            unary[x] = unary[x] + (u[:, None] + m).min(axis=0)
        else:                            # one edge between the two neighbours
            i = len(edges) + len(steps)    # a fresh id
            live[i] = edge_type(a, b, rows.reshape(-1), cols.reshape(-1), cols_u)
            at[a].add(i)
            at[b].add(i)
        queue.extend(x for x, _ in toward)
    return unary, list(live.values()), steps, offset


def back_substitute(steps: list, choice: dict) -> dict:
    """Each eliminated decision's cheapest candidate given its neighbours' choices, the
    last eliminated first (its neighbours were all chosen or eliminated after it)."""
    choice = dict(choice)
    for s in reversed(steps):
        total = s.unary.copy()
        for x, m in s.toward:
            total += m[:, choice[x]]
        choice[s.t] = int(np.argmin(total))
    return choice
