"""The candidate strategies of one op, read off its factor rule.

A candidate gives every mesh axis to at most one factor the rule lets split (a
factor given several axes takes them in every order: ('b', 'a') splits the factor
major over 'b', which lays the devices out differently from ('a', 'b') and can be
the cheaper plan), such that every split divides its factor and a
dim made of several factors is split only from its major end. ``fixed`` factors
(a user's mark) keep their axes. The all-whole assignment, "replicated", is
always first.
"""
from __future__ import annotations

import itertools
from typing import Optional, Sequence

from ...ir.layout import Layout
from ...ir.mesh import Mesh

from ..rules.base import FactorRule
from ..sharding import Axes, broken_nesting


def factor_assignments(rule: FactorRule, mesh: Mesh,
                       fixed: Optional[Sequence[Optional[Axes]]] = None) -> list[tuple[Axes, ...]]:
    """Every allowed assignment of mesh axes to the rule's factors (see module doc)."""
    n = rule.num_factors
    fixed = list(fixed) if fixed is not None else [None] * n
    taken = {a for axes in fixed if axes for a in axes}
    free_axes = [a for a in mesh.axis_names if a not in taken]
    open_factors = [f for f in range(n) if fixed[f] is None and rule.shardable(f)]
    out, seen = [], set()
    for choice in itertools.product([None] + open_factors, repeat=len(free_axes)):
        factors = [tuple(fixed[f]) if fixed[f] is not None else () for f in range(n)]
        for a, f in zip(free_axes, choice):
            if f is not None:
                factors[f] = factors[f] + (a,)
        if any(rule.sizes[f] % mesh.axes_size(factors[f]) for f in range(n)):
            continue
        for ordered in _orders(factors, [f in open_factors for f in range(n)]):
            if broken_nesting(rule, ordered, mesh) is not None:
                continue
            key = tuple(ordered)
            if key not in seen:
                seen.add(key)
                out.append(key)
    out.sort(key=lambda c: sum(len(a) for a in c))   # replicated (or the fixed part alone) first
    return out


def tensor_layouts(shape: Sequence[int], mesh: Mesh) -> list[Layout]:
    """Every layout of a tensor of ``shape``: each mesh axis on one dim or none (a dim
    given several axes takes them in every order), splits dividing their dims.
    Replicated first. (Stored split over every axis, gathered where an op computes
    with it: the FSDP layout of a weight is one of these, its gather a priced move.)"""
    out = []
    for choice in itertools.product([None] + list(range(len(shape))), repeat=len(mesh.axis_names)):
        dims = [()] * len(shape)
        for a, d in zip(mesh.axis_names, choice):
            if d is not None:
                dims[d] = dims[d] + (a,)
        if all(s % mesh.axes_size(d) == 0 for s, d in zip(shape, dims)):
            out.extend(Layout(tuple(o)) for o in _orders(dims, [True] * len(dims)))
    out.sort(key=lambda l: len(l.sharded_axes()))
    return out


def _orders(groups: list, free: list) -> list[list]:
    """``groups`` (tuples of axes) with each ``free`` group's axes in every order (mesh
    order first)."""
    options = [list(itertools.permutations(g)) if ok and len(g) > 1 else [tuple(g)] for g, ok in zip(groups, free)]
    return [list(c) for c in itertools.product(*options)]
