"""Which dims of which values are one factor, across a whole set of ops.

A union-find over (value, dim): wherever a rule maps two dims to the same factor,
they are joined. Used to summarise a loop body as one rule and to find which
input dims of a ``shard()`` call its split counts must share.
"""
from __future__ import annotations

from typing import Iterable

from ...ir.graph import Op, Value

from .base import rule_for


class DimClasses:
    def __init__(self):
        self.parent: dict = {}
        self.flops = 0.0
        self._reduced_keys: list = []

    def find(self, x):
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b) -> None:
        self.parent[self.find(a)] = self.find(b)

    def add_ops(self, ops: Iterable[Op]) -> None:
        for op in ops:
            rule = rule_for(op)
            self.flops += rule.flops
            for f, places in enumerate(rule.factor_dims()):
                keys = []
                for side, t, d in places:
                    v = op.inputs[t] if side == "operand" else op.outputs[t]
                    fs = (rule.operands[t] if side == "operand" else rule.results[t])[d]
                    if len(fs) == 1:
                        keys.append((v.id, d))
                for a, b in zip(keys, keys[1:]):
                    self.union(a, b)
                if f in rule.reduction and keys:
                    self._reduced_keys.append(keys[0])

    def tie(self, xs: list[Value], ys: list[Value]) -> None:
        """Make each dim of xs the same factor as the same dim of ys (a loop carry)."""
        for x, y in zip(xs, ys):
            for d in range(min(x.type.rank, y.type.rank)):
                self.union((x.id, d), (y.id, d))

    def reduced_roots(self) -> set:
        """Classes that some op reduces (contracts) over."""
        return {self.find(k) for k in self._reduced_keys}
