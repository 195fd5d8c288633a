"""Pass ``sink-reductions``: move an all_reduce past a linear op.

Before: ``%3 = add_any(%1, %2)`` needs both operands complete, so each pending
partial sum is all-reduced first.
After: the add carries the partial on (``%3`` is partial) and one all_reduce
follows it: ``add(AR(a), AR(b))`` became ``AR(add(a, b))``. Only where the
partial values have no other user and the op makes nothing bigger, so the
rewrite never costs more than it saves.

First, sums are regrouped so that partials meet before a complete value joins
them. A post-LN transformer's backward adds each projection's partial gradient
into a sum that already holds the residual's complete gradient:
``t1 = add(r, AR(p1)); t2 = add(t1, AR(p2))`` became
``s = add(p1, p2); t2 = add(r, AR(s))``: one all_reduce where there were two.
"""
from __future__ import annotations

import math

from ..ir.graph import CONSTRAINT, Graph

from .sharding import OpStrategy


class SinkReductions:
    name = "sink-reductions"

    def __call__(self, graph: Graph) -> Graph:
        regroup_partial_sums(graph)
        sink_reductions(graph, self.worth_carrying)
        for op in graph.ops:
            for body in op.subgraphs:
                self(body)
        return graph

    def worth_carrying(self, op, vals) -> bool:
        """Whether ``op`` carrying the partial of ``vals`` on saves bytes: its results are no
        bigger than them, so the one all_reduce after it moves no more than those before.
        The one choice here that depends on shapes, not layouts (a pipeline replays it at
        its other batch sizes: ``compiler/pipeline_submesh.py``)."""
        return all(math.prod(r.type.shape) <= math.prod(v.type.shape) for r in op.outputs for v in vals)


_SUMS = ("add", "add_any")


def regroup_partial_sums(graph: Graph) -> int:
    """Rewrite ``t2 = add(add(r, p1), p2)`` with ``r`` complete and ``p1``, ``p2`` equal
    pending partial sums into ``t2 = add(r, add(p1, p2))`` with the inner add carrying
    the partial on, so the two partials are reduced once, together. The inner add moves
    to just before the outer one (``p2`` may be made after it). Only where ``p1``,
    ``p2`` and the inner sum have no other user and no layout but the partial changes:
    the rewrite then saves exactly one reduction. Returns how many it regrouped."""
    mesh = graph.mesh
    users = graph.users()
    producer = {v: op for op in graph.ops for v in op.outputs}
    outputs = set(graph.outputs)
    before: dict = {}     # op -> ops moved to just before it

    def sole_use(v, op) -> bool:
        return v not in outputs and users.get(v) == [op]

    def plain_sum(op) -> bool:
        st = op.strategy
        return (op.kind in _SUMS and st is not None and st.passthrough is None and len(op.inputs) == 2
                and st.rule.linear and st.rule.linear[0][0] == (0, 1)
                and op.inputs[0] is not op.inputs[1] and not any(v.is_literal or v.layout is None for v in op.inputs))

    count = 0
    for outer in graph.ops:
        if not plain_sum(outer):
            continue
        for j in (0, 1):
            p2, t1 = outer.inputs[j], outer.inputs[1 - j]
            inner = producer.get(t1)
            if (not p2.layout.partial or p2.layout.partial_op != "sum" or t1.layout.partial
                    or inner is None or not plain_sum(inner) or not sole_use(t1, outer) or not sole_use(p2, outer)):
                continue
            k = 0 if inner.inputs[0].layout.partial else 1
            p1, r = inner.inputs[k], inner.inputs[1 - k]
            if p1.layout != p2.layout or r.layout.partial or not sole_use(p1, inner):
                continue
            st = inner.strategy
            carried = OpStrategy(st.rule, st.factors, (0, p1.layout.partial))
            if (any(set(a) & set(p1.layout.partial) for a in st.factors if a)
                    or carried.operand_layout(0, p1.type.rank, mesh) != p1.layout
                    or r.layout != outer.strategy.operand_layout(1 - j, r.type.rank, mesh)
                    or p1.type != p2.type or r.type != t1.type):
                continue
            inner.inputs = [p1, p2]
            inner.strategy = carried
            t1.layout = carried.result_layout(0, mesh)
            outer.inputs[j], outer.inputs[1 - j] = t1, r
            users[p2] = [inner]
            before.setdefault(outer, []).append(inner)
            count += 1
            break
    if count:
        moved = {op for ops in before.values() for op in ops}
        order: list = []

        def emit(op):
            for m in before.get(op, ()):
                emit(m)
            order.append(op)
        for op in graph.ops:
            if op not in moved:
                emit(op)
        graph.ops = order
    return count


def sink_reductions(graph: Graph, worth_carrying) -> None:
    """Rewrite, in program order, each op that can carry its operands' partial on, where
    ``worth_carrying(op, partial_operands)``."""
    mesh = graph.mesh
    users = graph.users()
    for op in graph.ops:
        st = op.strategy
        if st is None or st.passthrough is not None or op.kind == CONSTRAINT:
            continue
        for gi, (group, gop) in enumerate(st.rule.linear):
            vals = [op.inputs[n] for n in group]
            if any(v.is_literal or v.layout is None for v in vals):
                continue
            first = vals[0].layout
            if not first.partial or first.partial_op != gop:
                continue
            same = all(v.layout.partial == first.partial and v.layout.partial_op == gop for v in vals)
            others_whole = all(not v.layout.partial for n, v in enumerate(op.inputs)
                               if n not in group and not v.is_literal and v.layout is not None)
            sole_user = all(len(users.get(v, [])) == 1 and v not in graph.outputs for v in vals)
            free_axes = not any(set(a) & set(first.partial) for a in st.factors if a)
            only_reduced = all(st.operand_layout(n, op.inputs[n].type.rank, mesh) == op.inputs[n].layout.without_partial()
                               for n in group)
            if same and others_whole and sole_user and free_axes and only_reduced and worth_carrying(op, vals):
                op.strategy = OpStrategy(st.rule, st.factors, (gi, first.partial))
                for n, v in enumerate(op.outputs):
                    v.layout = op.strategy.result_layout(n, mesh)
                break
