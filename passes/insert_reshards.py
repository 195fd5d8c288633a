"""Pass ``insert-reshards``: make every operand arrive in the layout its op needs.

Before: ops have strategies; values have the layouts their producers make;
``sharding_constraint`` ops pin layouts.
After: for every op, each operand's layout equals the layout its strategy
requires; where they differed a ``reshard`` op (source -> target layout) now
sits before the first op that needs it, shared by all that need the same target.
Constraint ops are gone (a constraint is just a reshard to its pinned layout).
Graph outputs are never partial: a pending sum is reduce-scattered onto a dim
(or all-reduced, if that is cheaper), unless the user pinned an output layout.

Example (seed network): ``relu`` needs ``[{d0}, {d1,d2}]`` but the first matmul
makes ``[{d0}, {}] partial_sum{d1,d2}``, so a reshard between them is inserted.
"""
from __future__ import annotations

from typing import Optional

from ..ir.graph import CONSTRAINT, RESHARD, Graph, Op, Value
from ..ir.layout import Layout

from .cost import DEFAULT_COST, CostModel
from .redistribute import redistribution_cost


class InsertReshards:
    name = "insert-reshards"

    def __init__(self, allow_reduce_scatter: bool = True, cost: CostModel = DEFAULT_COST):
        self.allow_reduce_scatter = allow_reduce_scatter
        self.cost = cost

    def __call__(self, graph: Graph) -> Graph:
        mesh = graph.mesh
        new_ops: list[Op] = []
        made: dict[tuple, Value] = {}
        alias: dict[Value, Value] = {}

        def reshard(v: Value, target: Layout, op, note: Optional[str] = None) -> Value:
            if v.layout is target or v.layout == target:
                return v
            key = (v.id, target)
            if key not in made:
                if note is None:   # written only for the reshards made (it reads the source line)
                    note = f"for {op.kind} at {op.source}" if op.source else f"for {op.kind}"
                w = Value(v.type, layout=target)
                new_ops.append(Op(RESHARD, [v], [w], {"src": v.layout, "dst": target},
                                  source=op.source if op is not None else None, origin="redistribution",
                                  note=note))
                made[key] = w
            return made[key]

        for op in graph.ops:
            op.inputs = [alias.get(v, v) for v in op.inputs]
            if op.kind == CONSTRAINT:
                alias[op.outputs[0]] = reshard(op.inputs[0], op.outputs[0].layout, op)
                continue
            for n, v in enumerate(op.inputs):
                if v.is_literal:
                    continue
                need = op.strategy.operand_layout(n, v.type.rank, mesh)
                op.inputs[n] = reshard(v, need, op)
            new_ops.append(op)
        outputs = [alias.get(v, v) for v in graph.outputs]
        for i, v in enumerate(outputs):
            if v.is_literal:
                continue   # a constant holds the same on every rank: any layout is a local broadcast (lowering)
            target = graph.pinned_outputs.get(i)
            if target is None and i in graph.tied_outputs:
                target = graph.inputs[graph.tied_outputs[i]].layout   # state comes back as it went in
            if target is None:
                target = self.output_layout(v, mesh)
            outputs[i] = reshard(v, target, None, f"for output {i}")
        graph.outputs = outputs
        graph.ops = new_ops
        for op in graph.ops:
            for body in op.subgraphs:
                self(body)
        return graph

    def output_layout(self, v: Value, mesh) -> Layout:
        """The cheapest complete layout for an output that is still partial."""
        return cheapest_completion(v.type.shape, v.type.itemsize, v.layout, mesh, self.allow_reduce_scatter,
                                   self.cost)[0]


def cheapest_completion(shape, itemsize, layout: Layout, mesh, allow_reduce_scatter: bool = True,
                        cost: CostModel = DEFAULT_COST) -> tuple[Layout, float]:
    """(layout, time) of completing a pending partial the cheapest way: an all_reduce,
    or a reduce_scatter onto a dim. Propagation charges this to a strategy whose
    result nobody asks for in a given layout, and insert-reshards does it."""
    if not layout.partial:
        return layout, 0.0
    options = [layout.without_partial()]
    if layout.partial_op == "sum" and allow_reduce_scatter:
        for d in range(layout.rank):
            cand = Layout(layout.dims).with_dim(d, layout.dims[d] + layout.partial)
            if not cand.problems(shape, mesh):
                options.append(cand)
    best = None
    for i, cand in enumerate(options):
        t = redistribution_cost(shape, itemsize, layout, cand, mesh, allow_reduce_scatter, cost)
        key = (round(t, 15), max((len(d) for d in cand.dims), default=0), i)
        if best is None or key < best[0]:
            best = (key, cand, t)
    return best[1], best[2]
