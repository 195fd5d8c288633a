"""Strategies: an assignment of mesh axes to the factors of an op's rule, and the
two projections between strategies and tensor layouts."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Sequence

from ..ir.layout import Layout
from ..ir.mesh import Mesh

from .rules.base import DimFactors, FactorRule

Axes = tuple[str, ...]


def dim_axes(fs: DimFactors, factors: Sequence[Optional[Axes]], rule: FactorRule, mesh: Mesh) -> Optional[Axes]:
    """The axes of a dim made of factors ``fs``; None if one of them is still unknown.

    A minor factor may only be sharded once every factor major to it is fully
    sharded, otherwise the dim's blocks would not be contiguous."""
    out: list[str] = []
    for i, f in enumerate(fs):
        axes = factors[f]
        if axes is None:
            return None
        if axes and out and mesh.axes_size(factors[fs[i - 1]]) != rule.sizes[fs[i - 1]]:
            raise ValueError("minor factor sharded under a partly sharded major factor")
        out.extend(axes)
    return tuple(out)


def split_dim(fs: DimFactors, axes: Axes, rule: FactorRule, mesh: Mesh) -> Optional[list[Axes]]:
    """Inverse of ``dim_axes``: hand a dim's axes (major first) to its factors.
    None when the dim's sharding cannot be expressed on these factors."""
    if not axes:
        return [()] * len(fs)
    return _split_sizes(tuple(rule.sizes[f] for f in fs), tuple(axes), mesh)


@lru_cache(maxsize=65536)
def _split_sizes(sizes: tuple, axes: Axes, mesh: Mesh) -> Optional[list[Axes]]:
    out: list[Axes] = []
    k = 0
    for size in sizes:
        taken, prod = [], 1
        while k < len(axes) and prod < size and size % (prod * mesh.axis_size(axes[k])) == 0:
            prod *= mesh.axis_size(axes[k])
            taken.append(axes[k])
            k += 1
        out.append(tuple(taken))
        if prod < size and k < len(axes):
            return None
    if k < len(axes):
        return None
    return out


_LAYOUTS: dict = {}   # layout -> the one equal object strategies hand out


def _canonical(layout: Layout) -> Layout:
    """One object per distinct layout, so the passes' many comparisons of what an op
    needs with what its operand has mostly end at ``is``."""
    if len(_LAYOUTS) > 65536:
        _LAYOUTS.clear()
    return _LAYOUTS.setdefault(layout, layout)


@dataclass(frozen=True)
class OpStrategy:
    """A complete strategy: mesh axes for every factor, plus the partial (if any)
    that passes through one of the rule's linear operand groups."""
    rule: FactorRule
    factors: tuple[Axes, ...]
    passthrough: Optional[tuple[int, Axes]] = None  # (index into rule.linear, partial axes)
    # layouts already worked out (ops with equal strategies share one object, and
    # every pass asks for the same layouts again)
    _layouts: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def _partial_in(self, n: int) -> tuple[Axes, str]:
        if self.passthrough is None:
            return (), "sum"
        group, op = self.rule.linear[self.passthrough[0]]
        return (self.passthrough[1], op) if n in group else ((), "sum")

    def operand_layout(self, n: int, rank: int, mesh: Mesh) -> Layout:
        key = (n, rank, id(mesh))
        out = self._layouts.get(key)
        if out is None:
            out = self._layouts[key] = _canonical(self._operand_layout(n, rank, mesh))
        return out

    def _operand_layout(self, n: int, rank: int, mesh: Mesh) -> Layout:
        fs = self.rule.operands[n]
        if fs is None:
            return Layout.replicated(rank)
        partial, op = self._partial_in(n)
        return Layout(tuple(dim_axes(d, self.factors, self.rule, mesh) for d in fs),
                      mesh.sort_axes(partial), op)

    def result_partial(self, mesh: Mesh) -> tuple[Axes, str]:
        return result_partial(self.rule, self.factors, self.passthrough, mesh)

    def result_layout(self, n: int, mesh: Mesh) -> Layout:
        key = ("result", n, id(mesh))
        out = self._layouts.get(key)
        if out is None:
            out = self._layouts[key] = _canonical(self._result_layout(n, mesh))
        return out

    def _result_layout(self, n: int, mesh: Mesh) -> Layout:
        partial, op = self.result_partial(mesh)
        return Layout(tuple(dim_axes(d, self.factors, self.rule, mesh) for d in self.rule.results[n]),
                      partial, op)

    def problems(self, mesh: Mesh) -> list[str]:
        out, used = [], []
        for f, axes in enumerate(self.factors):
            n = mesh.axes_size(axes)
            if self.rule.sizes[f] % n:
                out.append(f"factor of size {self.rule.sizes[f]} split {n} ways")
            if axes and not self.rule.shardable(f):
                out.append(f"factor of size {self.rule.sizes[f]} must stay whole")
            used += axes
        if self.passthrough:
            used += self.passthrough[1]
        if len(set(used)) != len(used):
            out.append(f"mesh axes used twice: {used}")
        return out


def result_partial(rule: FactorRule, factors, passthrough, mesh: Mesh) -> tuple[Axes, str]:
    """The pending partial (axes, op) an op's results carry: its sharded reduction
    factors, plus a partial passed through a linear operand group."""
    axes = [a for f in rule.reduction for a in (factors[f] or ())]
    op = rule.reduce_op or "sum"
    if passthrough is not None:
        axes += list(passthrough[1])
        op = rule.linear[passthrough[0]][1]
    return mesh.sort_axes(axes), op


PartialDims = list  # per dim: Optional[Axes] (None: not known yet)


def project(fs_per_dim, dims: Optional[Sequence[Optional[Axes]]], rule: FactorRule, mesh: Mesh) -> dict[int, Axes]:
    """Factor proposals read off a tensor's (possibly partly known) layout.
    Dims whose sharding the factors cannot express propose nothing."""
    out: dict[int, Axes] = {}
    if dims is None:
        return out
    for fs, axes in zip(fs_per_dim, dims):
        if axes is None or not fs:
            continue
        split = split_dim(fs, axes, rule, mesh)
        if split is None:
            continue
        for f, a in zip(fs, split):
            out[f] = a
    return out


def factors_from_operands(rule: FactorRule, op, layouts: Sequence[Optional[Layout]], mesh: Mesh):
    """Factors fixed by fully known operand layouts (used for user-annotated ops).
    Returns (factors with None where no operand says, problem or None)."""
    factors: list[Optional[Axes]] = [None] * rule.num_factors
    said_by: dict[int, tuple[int, int]] = {}
    for n, layout in enumerate(layouts):
        fs_dims = rule.operands[n] if n < len(rule.operands) else None
        if layout is None or fs_dims is None:
            continue
        for d, (fs, axes) in enumerate(zip(fs_dims, layout.dims)):
            if not fs:
                if axes:
                    return factors, (f"operand {n} dim {d} is split over {axes} but {op.kind} keeps that "
                                     "dim whole (size 1 or broadcast)")
                continue
            split = split_dim(fs, axes, rule, mesh)
            if split is None:
                return factors, (f"operand {n} dim {d} is split over mesh axes {axes}, which {op.kind} cannot "
                                 "carry through that dim")
            for f, a in zip(fs, split):
                if factors[f] is not None and factors[f] != a:
                    n0, d0 = said_by[f]
                    what = "contracted together" if f in rule.reduction else "the same dimension"
                    return factors, (f"operand {n0} dim {d0} and operand {n} dim {d} are {what} in {op.kind}, but "
                                     f"are split over mesh axes {factors[f] or '()'} and {a or '()'}")
                if a and not rule.shardable(f):
                    return factors, (f"operand {n} dim {d} is split but {op.kind} needs that dim whole")
                factors[f] = a
                said_by[f] = (n, d)
    used = [a for axes in factors if axes for a in axes]
    if len(set(used)) != len(used):
        return factors, f"the operand layouts use a mesh axis twice across the dims of {op.kind}: {used}"
    return factors, None
