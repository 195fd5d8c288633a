"""One evaluator of a whole plan: op strategies and input layouts -> modeled seconds.

The number ``plan.cost`` reports for a searched plan, the one propagation's rounds
compare, and the one the search's objective equals for its solution (a test holds
each engine's own figure to it). Walked op by op in program order: each op's compute
per device (``cost.ComputeTimes``), each operand moved from the layout its producer
makes (or its argument arrives in) to the layout the op needs, each output to its
pinned layout, its argument's layout (returned state) or its cheapest completion,
every move priced by ``pricing.Prices`` (an output's by ``Prices.output``).
``shared_copies``: a value needed in one layout by several ops is moved once (as
``insert-reshards`` writes it, and as propagation plans), but a stored value (an
argument, its cast or view) gathered bigger is gathered per use as insert-reshards
writes it too (FSDP style: each gather freed after its use). ``decisions`` (op -> the
search's decision it belongs to): the search's linear model instead, where the reads of
a value by one decision share a move per layout (by the same rule), and reads by
different decisions are each priced on their own (an edge term prices one pair of
decisions). With neither, every move once per reader.
"""
from __future__ import annotations

from typing import Optional

from ..cost import ComputeTimes
from ..insert_reshards import gathered_per_use
from .context import PlanContext
from .pricing import Prices


def evaluate_plan(ctx: PlanContext, ops: dict, inputs: dict, prices: Prices, compute: ComputeTimes, *,
                  shared_copies: bool = False, decisions: Optional[dict] = None, detail: bool = True,
                  breakdown: Optional[dict] = None) -> dict:
    """What a plan (op -> OpStrategy, input index -> Layout) costs: {"compute",
    "communication", "bytes", "flops"} per device (seconds, bytes moved, flops; the
    last two only with ``detail``); ``breakdown`` gets them per op kind ("(outputs)"
    for the outputs' moves)."""
    detail = detail or breakdown is not None
    g = ctx.graph
    mesh, step_end = g.mesh, ctx.step_end
    layout = {g.inputs[i]: l for i, l in inputs.items()}
    seconds = communication = nbytes = flops = 0.0
    moved: set = set()
    stored = ctx.stored if shared_copies or decisions is not None else frozenset()
    # strategies are shared objects, and an op's signature names all its compute and its
    # layouts read of it (rule, types, what fusion keeps out of memory): per pair, once
    placed: dict = {}   # (id of a strategy, signature) -> (seconds, flops, operand needs, result layouts)
    signature = ctx.signatures

    def add(kind, **x):   # the breakdown by op kind
        b = breakdown.setdefault(kind, dict(compute=0.0, communication=0.0, bytes=0.0))
        for what, y in x.items():
            b[what] += y

    def move(kind, v, have, need, reader=None) -> tuple:
        """(seconds, bytes) of moving ``v`` from ``have`` to ``need`` for the op ``reader``
        (None: an output's move)."""
        if have == need:
            return 0.0, 0.0
        if shared_copies:
            copy = (v, need)
        elif decisions is not None and reader is not None:
            copy = (v, need, decisions[reader])
        else:
            copy = None
        if copy is not None and not gathered_per_use(v, have, need, stored, mesh):
            if copy in moved:
                return 0.0, 0.0
            moved.add(copy)
        t = prices.move(v, have, need, mesh, step_end)
        b = prices.wire_bytes(v, have, need, mesh, step_end) if detail else 0.0
        if breakdown is not None:
            add(kind, communication=t, bytes=b)
        return t, b

    for op in g.ops:
        st = ops[op]
        key = (id(st), signature[op])
        p = placed.get(key)
        if p is None:
            p = placed[key] = (compute.time(op, st.rule.flops, st.factors),
                               compute.work(op, st.rule.flops, st.factors)[0] if detail else 0.0,
                               tuple(None if v.literal is not None else st.operand_layout(m, v.type.rank, mesh)
                                     for m, v in enumerate(op.inputs)),
                               tuple(st.result_layout(k, mesh) for k in range(len(op.outputs))))
        seconds += p[0]
        flops += p[1]
        if breakdown is not None:
            add(op.kind, compute=p[0])
        for v, need in zip(op.inputs, p[2]):
            have = layout.get(v)
            if have is need or have is None or need is None:
                continue
            t, b = move(op.kind, v, have, need, op)
            communication += t
            nbytes += b
        for v, result in zip(op.outputs, p[3]):
            layout[v] = result
    for i, v in enumerate(g.outputs):
        if v.literal is not None or v not in layout:
            continue
        target = prices.output(g, i, layout[v], lambda j: layout[g.inputs[j]], mesh, step_end)[0]
        t, b = move("(outputs)", v, layout[v], target)
        communication += t
        nbytes += b
    return dict(compute=seconds, communication=communication, bytes=nbytes, flops=flops)


def evaluate_written(ctx: PlanContext, prices: Prices, compute: ComputeTimes, detail: bool = True) -> dict:
    """``evaluate_plan`` of the plan written into ``ctx.graph`` (each op's strategy, each
    input's layout), a copy several ops need made once, as insert-reshards writes it."""
    g = ctx.graph
    return evaluate_plan(ctx, {op: op.strategy for op in g.ops}, {i: v.layout for i, v in enumerate(g.inputs)},
                         prices, compute, shared_copies=True, detail=detail)
