"""Pass ``sink-reductions``: move an all_reduce past a linear op.

Before: ``%3 = add_any(%1, %2)`` needs both operands complete, so each pending
partial sum is all-reduced first.
After: the add carries the partial on (``%3`` is partial) and one all_reduce
follows it: ``add(AR(a), AR(b))`` became ``AR(add(a, b))``. Only where the
partial values have no other user and the op makes nothing bigger, so the
rewrite never costs more than it saves.
"""
from __future__ import annotations

import math

from ..ir.graph import CONSTRAINT, Graph

from .sharding import OpStrategy


class SinkReductions:
    name = "sink-reductions"

    def __call__(self, graph: Graph) -> Graph:
        sink_reductions(graph)
        for op in graph.ops:
            for body in op.subgraphs:
                self(body)
        return graph


def sink_reductions(graph: Graph) -> None:
    """Rewrite, in program order, each op that can carry its operands' partial on."""
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
            smaller = all(math.prod(r.type.shape) <= math.prod(v.type.shape) for r in op.outputs for v in vals)
            if same and others_whole and sole_user and free_axes and only_reduced and smaller:
                op.strategy = OpStrategy(st.rule, st.factors, (gi, first.partial))
                for n, v in enumerate(op.outputs):
                    v.layout = op.strategy.result_layout(n, mesh)
                break
