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
    sharded, otherwise the dim's blocks would not be contiguous. Strategies are
    built so that this never happens (``may_shard``); meeting it here is a bug."""
    if len(fs) == 1:
        axes = factors[fs[0]]
        return axes if axes is None or type(axes) is tuple else tuple(axes)
    out: list[str] = []
    whole = True   # every factor so far fully sharded
    for f in fs:
        axes = factors[f]
        if axes is None:
            return None
        if axes and not whole:
            raise ValueError("minor factor sharded under a major factor that is not fully sharded")
        out.extend(axes)
        whole = whole and mesh.axes_size(axes) == rule.sizes[f]
    return tuple(out)


# -- nesting: factors that share a dim (a reshape's merged dims) ------------------

@dataclass(frozen=True)
class Nesting:
    """Which factors sit under which in some dim of a rule (a reshape's merged dims).
    Most rules have one factor per dim, and an empty nesting."""
    majors: dict      # factor -> the factors major to it in some dim
    depth: dict       # factor -> how many factors can sit above it (majors come first)
    places: tuple     # (side, tensor, dim, factors) of every dim with several factors


_NESTING: dict = {}   # id(rule) -> (rule, its nesting): rules are few and shared


def nesting(rule: FactorRule) -> Nesting:
    hit = _NESTING.get(id(rule))
    if hit is not None and hit[0] is rule:
        return hit[1]
    majors: dict = {}
    places = []
    for side, tensors in (("operand", rule.operands), ("result", rule.results)):
        for t, dims in enumerate(tensors):
            for d, fs in enumerate(dims or ()):
                if len(fs) > 1:
                    places.append((side, t, d, fs))
                for i in range(1, len(fs)):
                    majors.setdefault(fs[i], set()).update(fs[:i])
    depth: dict = {}

    def depth_of(f, seen=()):
        if f not in depth:
            depth[f] = 1 + max((depth_of(m, seen + (f,)) for m in majors.get(f, ()) if m not in seen), default=-1)
        return depth[f]
    for f in majors:
        depth_of(f)
    out = Nesting({f: tuple(sorted(m)) for f, m in majors.items()}, depth, tuple(places))
    if len(_NESTING) > 65536:
        _NESTING.clear()
    _NESTING[id(rule)] = (rule, out)
    return out


def may_shard(f: int, factors: Sequence[Optional[Axes]], rule: FactorRule, mesh: Mesh) -> bool:
    """May factor ``f`` take mesh axes, given the others (None: open)? Only once every
    factor major to it in some dim is fully sharded: then each rank's block of that
    dim is one contiguous run (the major part of a merged dim, or whole sub-factors
    in order); otherwise it would hold strided pieces that nothing redistributes."""
    for m in nesting(rule).majors.get(f, ()):
        axes = factors[m]
        if axes is None or mesh.axes_size(axes) != rule.sizes[m]:
            return False
    return True


def broken_nesting(rule: FactorRule, factors: Sequence[Optional[Axes]], mesh: Mesh) -> Optional[tuple[int, int]]:
    """(minor, major) of the first sharded factor whose major is not fully sharded
    (open factors count as whole), or None if every dim's blocks are contiguous."""
    for f, ms in nesting(rule).majors.items():
        if factors[f]:
            for m in ms:
                if mesh.axes_size(factors[m] or ()) != rule.sizes[m]:
                    return f, m
    return None


def keep_contiguous(rule: FactorRule, factors: list, mesh: Mesh) -> list:
    """``factors`` less every split that a major factor no longer carries (dropped
    splits become open, None), majors first so that dropping cascades."""
    nest = nesting(rule)
    if not nest.majors:
        return factors
    out = list(factors)
    for f in sorted(nest.majors, key=nest.depth.__getitem__):
        if out[f] and not may_shard(f, out, rule, mesh):
            out[f] = None
    return out


def regroup(rule: FactorRule, proposal: dict, mesh: Mesh) -> Optional[dict]:
    """A proposal that splits a minor factor under a major one that is not fully
    split, read instead through the dim where they meet: that dim keeps the axes
    the proposal gives it, handed to its factors from the major end. So a reshape
    whose operand arrives split on the minor part of a merge can still produce a
    result split as many ways (its operand is then redistributed). None when there
    is nothing to regroup or the axes cannot be handed out that way."""
    nest = nesting(rule)
    out = dict(proposal)
    changed = False
    for _, _, _, fs in nest.places:
        if any(f not in out for f in fs):
            continue
        if not any(out[f] and not may_shard(f, [out.get(g) for g in range(rule.num_factors)], rule, mesh)
                   for f in fs):
            continue
        split = split_dim(fs, tuple(a for f in fs for a in out[f]), rule, mesh)
        if split is None:
            continue
        out.update(zip(fs, split))
        changed = True
    return out if changed else None


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
        broken = broken_nesting(self.rule, self.factors, mesh)
        if broken:
            out.append(f"factor of size {self.rule.sizes[broken[0]]} split under factor of size "
                       f"{self.rule.sizes[broken[1]]}, which is not fully split: blocks not contiguous")
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
    Returns (factors with None where no operand says, (problem, fix) or None)."""
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
                                     "dim whole (size 1 or broadcast)", "leave that dim unsplit (1) in the strategy; the operator needs it whole")
                continue
            split = split_dim(fs, axes, rule, mesh)
            if split is None:
                return factors, (f"operand {n} dim {d} is split over mesh axes {axes}, which {op.kind} cannot "
                                 "carry through that dim", "split that dim over fewer or other mesh axes, or leave it "
                                 "unsplit (1)")
            for f, a in zip(fs, split):
                if factors[f] is not None and factors[f] != a:
                    n0, d0 = said_by[f]
                    what = "contracted together" if f in rule.reduction else "the same dimension"
                    return factors, (f"operand {n0} dim {d0} and operand {n} dim {d} are {what} in {op.kind}, but "
                                     f"are split over mesh axes {factors[f] or '()'} and {a or '()'}", "give dims that the operator combines the same split (or the same mesh axes)")
                if a and not rule.shardable(f):
                    return factors, (f"operand {n} dim {d} is split but {op.kind} needs that dim whole", "leave that dim unsplit (1) in the strategy; the operator needs it whole")
                factors[f] = a
                said_by[f] = (n, d)
    used = [a for axes in factors if axes for a in axes]
    if len(set(used)) != len(used):
        return factors, (f"the operand layouts use a mesh axis twice across the dims of {op.kind}: {used}",
                         "give each mesh axis to one dim only")
    broken = broken_nesting(rule, factors, mesh)
    if broken:
        return factors, _broken_words(rule, op, broken, said_by)
    return factors, None


def _broken_words(rule: FactorRule, op, broken: tuple[int, int], said_by: dict) -> tuple[str, str]:
    """Why a split cannot cross this op, and the fix: where the minor factor is split,
    and the dim where it sits under a major factor that is not split as much."""
    minor, major = broken
    n, d = said_by[minor]
    side, t, dm = next((side, t, dm) for side, t, dm, fs in nesting(rule).places if minor in fs and major in fs)
    return (f"operand {n} dim {d} is split, but {op.kind} makes it the minor (faster-varying) part of {side} {t} "
            f"dim {dm} while the major part (size {rule.sizes[major]}) is not split as much, so each device's block "
            f"of that dim would not be contiguous",
            f"split the major part of the merged dims instead, or mark the op after the {op.kind} so that the "
            f"compiler redistributes")
