"""Sharding rules as data.

A rule describes one primitive application the way an einsum does: every operand
and result dimension is made of *factors* (``dot_general`` of a matmul is
``[i,k],[k,j] -> [i,j]`` with ``k`` a reduction factor). A strategy assigns mesh
axes to factors; operand and result layouts follow from it. Rules are built per
op (they depend on shapes and params) by functions registered per primitive name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from ...ir.errors import sharding_error
from ...ir.graph import Op

DimFactors = tuple[int, ...]          # factors of one dim, major to minor (empty: size-1 / broadcast)
TensorFactors = tuple[DimFactors, ...]


@dataclass(frozen=True)
class FactorRule:
    sizes: tuple[int, ...]                         # size of each factor
    operands: tuple[Optional[TensorFactors], ...]  # None: operand takes no part (kept replicated)
    results: tuple[TensorFactors, ...]
    reduction: frozenset = frozenset()             # factors absent from the results
    reduce_op: Optional[str] = "sum"               # partial kind a sharded reduction factor leaves; None: keep whole
    need_replication: frozenset = frozenset()      # factors that must never be sharded
    # Groups of operands a partial value passes through unreduced: if exactly the
    # operands of a group carry the same partial, the result carries it too.
    linear: tuple[tuple[tuple[int, ...], str], ...] = ()
    flops: float = 0.0                             # work of the whole (unsharded) op

    @property
    def num_factors(self) -> int:
        return len(self.sizes)

    def shardable(self, f: int) -> bool:
        if f in self.need_replication:
            return False
        if f in self.reduction and self.reduce_op is None:
            return False
        return self.sizes[f] > 1

    def factor_dims(self) -> list[list[tuple[str, int, int]]]:
        """For each factor, the (side, tensor index, dim) places it occurs in."""
        out: list[list[tuple[str, int, int]]] = [[] for _ in self.sizes]
        for side, tensors in (("operand", self.operands), ("result", self.results)):
            for t, dims in enumerate(tensors):
                if dims is None:
                    continue
                for d, fs in enumerate(dims):
                    for f in fs:
                        out[f].append((side, t, d))
        return out


RuleFn = Callable[[Op], FactorRule]
LocalizeFn = Callable[[Op, list, list], dict]

RULES: dict[str, RuleFn] = {}
LOCALIZERS: dict[str, LocalizeFn] = {}


def register(*names: str):
    def deco(fn: RuleFn) -> RuleFn:
        for n in names:
            RULES[n] = fn
        return fn
    return deco


def register_localizer(*names: str):
    """Params that carry shapes must be rewritten to local shapes per rank."""
    def deco(fn: LocalizeFn) -> LocalizeFn:
        for n in names:
            LOCALIZERS[n] = fn
        return fn
    return deco


def rule_for(op) -> FactorRule:
    """The op's factor rule; an op with no rule is an error, never a silent replication."""
    fn = RULES.get(op.kind)
    if fn is None:
        raise sharding_error(f"primitive '{op.kind}' has no sharding rule, so shardprop cannot decide how to "
                             "split it", operator=op.kind, source=op.source,
                             shapes=tuple(v.type.shape for v in op.inputs),
                             fix=f"compute it outside the parallelized function, or register a rule with "
                                 f"@shardprop.passes.rules.register('{op.kind}')")
    return fn(op)


class FactorBuilder:
    """Small helper to allocate factors while building a rule."""

    def __init__(self):
        self.sizes: list[int] = []

    def new(self, size: int) -> int:
        self.sizes.append(int(size))
        return len(self.sizes) - 1

    def dims(self, shape) -> TensorFactors:
        """One fresh factor per dimension (none for size-1 dims)."""
        return tuple((self.new(s),) if s != 1 else () for s in shape)


def numel(shape) -> int:
    return math.prod(shape)
