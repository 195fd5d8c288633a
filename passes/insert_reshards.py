"""Pass ``insert-reshards``: make every operand arrive in the layout its op needs.

Before: ops have strategies; values have the layouts their producers make;
``sharding_constraint`` ops pin layouts.
After: for every op, each operand's layout equals the layout its strategy
requires; where they differed a ``reshard`` op (source -> target layout) now
sits before the first op that needs it, shared by all that need the same target.
Constraint ops are gone (a constraint is just a reshard to its pinned layout).
A stored value (an argument of the function, or a cast or view of one) that a use needs
gathered (more of it per device than it is stored with: a weight stored split,
FSDP style, by ``shard_params=True`` or by the search) is the exception to the
sharing: each use gets its own gather, after a tie (``TIE``), an identity that
the lowering writes as a data dependence on what the use reads besides
(``runtime/lower.py``). So XLA keeps each gather at its use and frees its copy
after it; a shared gather would be one buffer alive from the forward's use to
the backward's, and without the tie XLA runs every gather at the program's
start (docs/results/fsdp_memory.md). A layout request that gathers a stored
value (a shard() mark on a weight) is met the same way at each reader of its
result: the forward's and the backward's reads each gather their own copy to the
request's layout (and move it on from there where the reader needs another).
Only in the top-level program: a loop body's arguments are its carries and
constants, gathered once before the loop.
Graph outputs are never partial: a pending sum is reduce-scattered onto a dim
(or all-reduced, if that is cheaper), unless the user pinned an output layout.

Example (seed network): ``relu`` needs ``[{d0}, {d1,d2}]`` but the first matmul
makes ``[{d0}, {}] partial_sum{d1,d2}``, so a reshard between them is inserted.
"""
from __future__ import annotations

import math
from typing import Optional

from ..ir.graph import CONSTRAINT, RESHARD, Graph, Op, Value
from ..ir.layout import Layout

from .cost import DEFAULT_COST, CostModel
from .redistribute import redistribution_cost
from .rules.base import FactorBuilder, FactorRule, register, rule_for
from .sharding import OpStrategy

# tie(stored value) -> the same value, one per gathering use; the lowering makes it
# depend on what the use reads besides (runtime/lower.py GATHER_TIE)
TIE = "gather_tie"
CASTS = ("convert_element_type", "reduce_precision")   # a stored weight in another dtype is stored too
STORED_LIKE = CASTS + ("transpose", "reshape")            # ... and so is one read through a view


@register(TIE)
def _tie_rule(op: Op) -> FactorRule:
    """An identity: the result keeps the operand's layout, no work."""
    fb = FactorBuilder()
    dims = fb.dims(op.inputs[0].type.shape)
    return FactorRule(tuple(fb.sizes), (dims,), (dims,), flops=0.0)


def stored_values(graph: Graph) -> set:
    """The values a gathering use gathers per use: the function's arguments, and their
    casts (mixed precision casts a weight where it is stored), transposes (the
    backward's ``w.T``) and reshapes, of these in turn."""
    out = set(graph.inputs)
    for op in graph.ops:
        if op.kind in STORED_LIKE and len(op.inputs) == 1 and op.inputs[0] in out:
            out.add(op.outputs[0])
    return out


def gathers(v: Value, have: Layout, need: Layout, mesh) -> bool:
    """Does moving ``v`` from ``have`` to ``need`` make a bigger copy per device (a gather)?"""
    return not have.partial and math.prod(need.local_shape(v.type.shape, mesh)) > \
        math.prod(have.local_shape(v.type.shape, mesh))


def gathered_per_use(v: Value, have: Layout, need: Layout, stored, mesh) -> bool:
    """Is this move made at each use rather than once for every reader: a stored value
    (``stored_values``) gathered bigger, FSDP style, each gather freed after its use."""
    return v in stored and gathers(v, have, need, mesh)


def tie(v: Value, source) -> Op:
    """A tie of stored ``v``: its own copy, in ``v``'s layout, for one use's gather."""
    tied = Value(v.type, layout=v.layout, name_hint=v.name_hint)
    op = Op(TIE, [v], [tied], {}, source=source, origin="redistribution", note="keeps the gather at its use")
    rule = rule_for(op)
    op.strategy = OpStrategy(rule, tuple(axes for axes, n in zip(v.layout.dims, v.type.shape) if n != 1))
    return op


class InsertReshards:
    name = "insert-reshards"

    def __init__(self, allow_reduce_scatter: bool = True, cost: CostModel = DEFAULT_COST):
        self.allow_reduce_scatter = allow_reduce_scatter
        self.cost = cost

    def __call__(self, graph: Graph, top_level: bool = True) -> Graph:
        mesh = graph.mesh
        new_ops: list[Op] = []
        made: dict[tuple, Value] = {}
        alias: dict[Value, Value] = {}
        stored = stored_values(graph) if top_level else set()

        def reshard(v: Value, target: Layout, op, note: Optional[str] = None) -> Value:
            if v.layout is target or v.layout == target:
                return v
            per_use = op is not None and gathered_per_use(v, v.layout, target, stored, mesh)
            key = (v.id, target)
            if per_use or key not in made:
                if note is None:   # written only for the reshards made (it reads the source line)
                    note = f"for {op.kind} at {op.source}" if op.source else f"for {op.kind}"
                src = v
                if per_use:
                    new_ops.append(tie(v, op.source))
                    src = new_ops[-1].outputs[0]
                w = Value(v.type, layout=target)
                new_ops.append(Op(RESHARD, [src], [w], {"src": v.layout, "dst": target},
                                  source=op.source if op is not None else None, origin="redistribution",
                                  note=note))
                if per_use:
                    return w
                made[key] = w
            return made[key]

        # a request (constraint) that gathers a stored value: its result -> (the stored
        # value, the request's layout); each reader gathers the stored value to that
        # layout itself (what the plan priced the reader's move from)
        at_use: dict[Value, tuple] = {}
        for op in graph.ops:
            op.inputs = [alias.get(v, v) for v in op.inputs]
            if op.kind == CONSTRAINT:
                v, target = at_use.get(op.inputs[0], (op.inputs[0],))[0], op.outputs[0].layout
                if gathered_per_use(v, v.layout, target, stored, mesh):
                    at_use[op.outputs[0]] = (v, target)
                else:
                    alias[op.outputs[0]] = reshard(v, target, op)
                continue
            for n, v in enumerate(op.inputs):
                if v.is_literal:
                    continue
                if v in at_use:      # gathered here to the request's layout, then on as the op needs
                    v = reshard(*at_use[v], op)
                need = op.strategy.operand_layout(n, v.type.rank, mesh)
                op.inputs[n] = reshard(v, need, op)
            new_ops.append(op)
        outputs = [alias.get(v, v) for v in graph.outputs]
        for i, v in enumerate(outputs):
            if v.is_literal:
                continue   # a constant holds the same on every rank: any layout is a local broadcast (lowering)
            if v in at_use:
                v = reshard(*at_use[v], None, f"for output {i}")
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
                self(body, top_level=False)
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
