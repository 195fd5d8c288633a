"""FSDP / ZeRO-3 as a hand plan: ``parallelize(..., shard_params=True)``.

The plan is the one the step gets without it, stored split over the data-parallel
axes. Each parameter and optimizer-state leaf keeps the layout that plan gives it
(replicated under data parallel, a tensor-parallel split under Megatron's marks)
and adds the data-parallel axes it does not already use on the first dim they
divide: that is how it lives between steps. Each read of a parameter by an op
that computes with it (a matmul, a bias add, a lookup) reads it through a layout
request for the planned layout, so the compiler all-gathers it right before that
use, once per use: forward and backward each gather their own copy, freed after
the use. That part is not FSDP's own: insert-reshards gives every gathering use
of a stored value (an argument, here stored split) its own gather after a tie
(``passes/insert_reshards.py`` ``TIE``), an identity that the lowering writes as
a data dependence on what the use reads besides (``runtime/lower.py``), for the
search's plans that store weights split just as for this one. Without it XLA
merges the forward's and the backward's gather of a weight (one operand) and
runs every gather at the program's start, so every layer's gathered weights
live through the whole step (docs/results/fsdp_memory.md). The gradient of a
stored-split parameter meets the stored split in
the optimizer's update, so its partial sum is completed by a reduce_scatter.
What reads a parameter elementwise at its own shape (the optimizer's update,
weight decay) reads the stored split, with no gather.

Loops: a parameter read by a loop (layers stacked under ``lax.scan``) is gathered
whole before the loop, not per iteration.
"""
from __future__ import annotations

from typing import Sequence

from ..ir.graph import CONSTRAINT, Graph, Op, Value
from ..ir.layout import Layout
from ..ir.mesh import Mesh
from ..passes.insert_reshards import CASTS
from ..passes.rules.elementwise import KINDS as ELEMENTWISE
from .pipeline import Options, default_passes

GATHER_ROLE = "gather_at_use"   # the role of the layout requests FSDP adds (dumps show it)


def storage_layout(use: Layout, shape: Sequence[int], mesh: Mesh, axes: Sequence[str]) -> Layout:
    """``use`` with every axis of ``axes`` it leaves free added to the first dim whose
    local size they divide (all of them on one dim, in mesh order); ``use`` itself
    where no dim takes them (a scalar, a tiny bias: kept as planned)."""
    free = tuple(a for a in axes if a not in use.used_axes())
    if not free:
        return use
    n = mesh.axes_size(free)
    local = use.local_shape(shape, mesh)
    for d, size in enumerate(local):
        if size % n == 0 and size >= n:
            return use.with_dim(d, use.dims[d] + free)
    return use


def gathers_at_use(op: Op, v: Value) -> bool:
    """Does ``op`` compute with parameter ``v`` (so reads it gathered)? Not a layout
    request of the user's (it moves the value itself), not an elementwise op at the
    parameter's own shape (the optimizer's update: it works on the stored split)."""
    if op.kind == CONSTRAINT:
        return False
    if op.kind in ELEMENTWISE and all(o.type.shape == v.type.shape for o in op.outputs):
        return False
    return True


class PlannedLayouts(dict):
    """Input index -> the layout the plan without FSDP gives it; ``marks``: the layout
    each layout request (a ``CONSTRAINT`` op of the graph, in program order) makes."""
    marks: tuple = ()


def planned_input_layouts(graph: Graph, options: Options) -> PlannedLayouts:
    """Input index -> the layout the plan without FSDP gives it (the strategy passes only),
    and the layouts its layout requests make (``PlannedLayouts.marks``)."""
    bind, choose = default_passes(options)[:2]
    graph = choose(bind(graph))
    out = PlannedLayouts({i: v.layout for i, v in enumerate(graph.inputs)})
    out.marks = [op.outputs[0].layout.without_partial() for op in graph.ops if op.kind == CONSTRAINT]
    return out


def apply_fsdp(graph: Graph, planned: dict, params: Sequence[int], state: Sequence[int],
                 axes: Sequence[str]) -> dict:
    """Store the leaves ``params`` and ``state`` (input indices) split over ``axes``
    and gather each parameter at every use to its ``planned`` layout (input index ->
    Layout in the plan without FSDP). A user's layout request on a parameter (a
    shard() mark) gathers it for the first use of its result; each later use (the
    backward's) gathers it again, to the request's planned layout
    (``PlannedLayouts.marks``). A parameter cast to another dtype (mixed precision)
    is cast stored split, and each use of the cast gathers it. Returns {input index:
    storage layout}."""
    mesh = graph.mesh
    stored = {}
    for i in list(params) + list(state):
        v = graph.inputs[i]
        use = planned[i].without_partial()
        store = storage_layout(use, v.type.shape, mesh, axes)
        if store != use:
            stored[i] = store
            graph.pinned_inputs[i] = store
    # value -> (what a use's gather starts from, the layout the use reads it in): the
    # parameters, layout requests on them (gathered from the parameter) and their casts
    # (gathered from the cast)
    gathered = {graph.inputs[i]: (graph.inputs[i], planned[i].without_partial()) for i in params if i in stored}
    marks = iter(getattr(planned, "marks", ()))
    fresh = set()      # requests' results whose first use reads the request itself
    ops = []
    for op in graph.ops:
        if op.kind in CASTS and op.inputs[0] in gathered and op.inputs[0] not in fresh:
            # (mixed precision) the cast runs on the stored split; each use of its result
            # gathers that, in the narrower dtype, as it would the parameter
            gathered[op.outputs[0]] = (op.outputs[0], gathered[op.inputs[0]][1])
            ops.append(op)
            continue
        if op.kind == CONSTRAINT:
            mark = next(marks, None)
            v = op.inputs[0]
            if v in gathered:
                param = gathered[v][0]
                op.inputs[0] = param      # (a later use of the request's result gathers the parameter again)
                if mark is not None:
                    gathered[op.outputs[0]] = (param, mark)
                    fresh.add(op.outputs[0])
            ops.append(op)
            continue
        uses = [k for k, v in enumerate(op.inputs) if v in gathered and v not in fresh and gathers_at_use(op, v)]
        for k in uses:
            param, layout = gathered[op.inputs[k]]
            use = Value(param.type, name_hint=param.name_hint)
            ops.append(Op(CONSTRAINT, [param], [use], {"role": GATHER_ROLE, "user_spec": layout.dims}, op.source))
            op.inputs[k] = use
        fresh.difference_update(v for v in op.inputs if gathers_at_use(op, v))
        ops.append(op)
    graph.ops = ops
    return stored

