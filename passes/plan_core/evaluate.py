"""One evaluator of a whole plan: op strategies and input layouts -> modeled seconds.

The number ``plan.cost`` reports for a searched plan, the one propagation's rounds
compare, and the one the search's objective equals for its solution (a test holds
each engine's own figure to it). Walked op by op in program order: each op's compute
per device (``cost.ComputeTimes``), each operand moved from the layout its producer
makes (or its argument arrives in) to the layout the op needs, each output to its
pinned layout, its argument's layout (returned state) or its cheapest completion,
every move priced by ``pricing.Prices`` (an output's by ``Prices.output``). ``shared_copies``: a value needed in one
layout by several ops is moved once (as ``insert-reshards`` writes it, and as
propagation plans); without, once per reader (the search's linear model, which
prices each edge on its own).
"""
from __future__ import annotations

from typing import Optional

from ..cost import ComputeTimes
from .context import PlanContext
from .pricing import Prices


def evaluate_plan(ctx: PlanContext, ops: dict, inputs: dict, prices: Prices, compute: ComputeTimes, *,
                  shared_copies: bool = False, detail: bool = True, breakdown: Optional[dict] = None) -> dict:
    """What a plan (op -> OpStrategy, input index -> Layout) costs: {"compute",
    "communication", "bytes", "flops"} per device (seconds, bytes moved, flops; the
    last two only with ``detail``); ``breakdown`` gets them per op kind ("(outputs)"
    for the outputs' moves)."""
    detail = detail or breakdown is not None
    g = ctx.graph
    mesh, step_end = g.mesh, ctx.step_end
    layout = {g.inputs[i]: l for i, l in inputs.items()}
    total = dict(compute=0.0, communication=0.0, bytes=0.0, flops=0.0)
    moved: set = set()
    needs: dict = {}   # (id of a strategy, operand) -> the layout it needs (strategies are shared objects)

    def add(kind, what, x):
        total[what] += x
        if breakdown is not None:
            b = breakdown.setdefault(kind, dict(compute=0.0, communication=0.0, bytes=0.0))
            if what in b:
                b[what] += x

    def move(kind, v, need):
        have = layout[v]
        if have is need or have == need:
            return
        if shared_copies:
            if (v, need) in moved:
                return
            moved.add((v, need))
        add(kind, "communication", prices.move(v, have, need, mesh, step_end))
        if detail:
            add(kind, "bytes", prices.wire_bytes(v, have, need, mesh, step_end))

    for op in g.ops:
        st = ops[op]
        add(op.kind, "compute", compute.time(op, st.rule.flops, st.factors))
        if detail:
            add(op.kind, "flops", compute.work(op, st.rule.flops, st.factors)[0])
        for m, v in enumerate(op.inputs):
            if v.literal is not None or v not in layout:
                continue
            key = (id(st), m)
            need = needs.get(key)
            if need is None:
                need = needs[key] = st.operand_layout(m, v.type.rank, mesh)
            move(op.kind, v, need)
        for k, v in enumerate(op.outputs):
            layout[v] = st.result_layout(k, mesh)
    for i, v in enumerate(g.outputs):
        if v.literal is not None or v not in layout:
            continue
        target = prices.output(g, i, layout[v], lambda j: layout[g.inputs[j]], mesh, step_end)[0]
        move("(outputs)", v, target)
    return total
