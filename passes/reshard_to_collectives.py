"""Pass ``reshard-to-collectives``: replace each ``reshard`` by the planner's
cheapest sequence of collectives (all_reduce, reduce_scatter, all_gather,
all_to_all, permute) and local slices.

Before: ``%5 = reshard(%4) {src=[{d0}, {}] partial_sum{d1,d2}, dst=[{d0}, {d1,d2}]}``
After:  ``%5 = reduce_scatter(%4) {axes=(d1,d2), dim=1}`` (or, in MindSpore's
form, ``all_reduce`` then ``slice``).
Postcondition: no reshard remains; each collective's input and output layouts
are those the planner's step goes between.
"""
from __future__ import annotations

from ..ir.graph import RESHARD, Graph, Op, Value

from .cost import DEFAULT_COST, CostModel
from .redistribute import permute_pairs, plan_redistribution


class ReshardToCollectives:
    name = "reshard-to-collectives"

    def __init__(self, allow_reduce_scatter: bool = True, cost: CostModel = DEFAULT_COST):
        self.allow_reduce_scatter = allow_reduce_scatter
        self.cost = cost

    def __call__(self, graph: Graph) -> Graph:
        mesh = graph.mesh
        out: list[Op] = []
        for op in graph.ops:
            if op.kind != RESHARD:
                out.append(op)
                continue
            src, dst = op.inputs[0], op.outputs[0]
            steps = self.steps(src, dst, mesh)
            cur = src
            for i, s in enumerate(steps):
                nxt = dst if i == len(steps) - 1 else Value(src.type, layout=s.after)
                params = dict(s.params)
                if s.kind == "permute":
                    params["pairs"] = permute_pairs(s.before, s.after, src.type.shape, mesh)
                params["wire_bytes"] = int(s.wire_bytes)
                out.append(Op(s.kind, [cur], [nxt], params, source=op.source, origin="redistribution",
                              note=op.note))
                cur = nxt
        graph.ops = out
        for op in graph.ops:
            for body in op.subgraphs:
                self(body)
        return graph

    def steps(self, src: Value, dst: Value, mesh) -> tuple:
        """The planner's cheapest steps from ``src``'s layout to ``dst``'s."""
        return plan_redistribution(src.type.shape, src.type.itemsize, src.layout, dst.layout, mesh,
                                   self.allow_reduce_scatter, self.cost)
