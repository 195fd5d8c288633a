"""Pass ``propagate-sharding``: give every op a strategy and every value a layout.

Before: user layouts are pinned (``bind-user-strategies``); other ops have none.
After: every op has a complete ``OpStrategy`` and an ``origin`` ("user",
"default", or the neighbour its strategy was propagated from), every value a
``Layout`` (the layout its producer makes; inputs: the layout they are fed in).
User strategies are never changed.

How: factor-based propagation from the user's layouts, breadth first, forwards
and backwards. An op decides a factor once some neighbour says something about
it; where neighbours disagree it takes the candidate of least cost (time to
redistribute its operands and results, plus its own compute, which counts
replicated work). A pending partial sum may pass through a linear op, be reduced
(all_reduce), or be scattered onto a dim (reduce_scatter); the cost decides.
Factors no neighbour ever constrains get the default (replicated) at the end.

``mode="semi_auto"``: no propagation; unannotated ops get MindSpore's default,
the first dim of the first operand split over all devices where it divides.
"""
from __future__ import annotations

import functools
from typing import Optional

from ..ir.graph import CONSTRAINT, Graph, Op

from .cost import DEFAULT_COST, ComputeTimes, CostModel
from .loop_boundaries import boundary_layouts, boundary_pairs
from .plan_core.context import PlanContext, RuleBook
from .plan_core.pricing import Prices
from .propagation_state import Propagation
from .rules import FIXED, rule_for
from .sharding import project


class PropagateSharding:
    name = "propagate-sharding"

    def __init__(self, mode: str = "sharding_propagation", cost: CostModel = DEFAULT_COST,
                 allow_reduce_scatter: bool = True, memoize: bool = True, whole_round: bool = True):
        if mode not in ("sharding_propagation", "semi_auto"):
            raise ValueError(f"unknown propagation mode {mode!r}")
        self.mode = mode
        self.cost = cost
        self.allow_reduce_scatter = allow_reduce_scatter
        # also price the plan that completes every pending partial whole, and keep it if
        # cheaper (False: MindSpore's op-by-op plan, the seed document's reproduction)
        self.whole_round = whole_round
        # situation at an op -> the choice made there (None: work every choice out afresh,
        # which must give the same plan: a test holds the memo to that)
        self.memo: Optional[dict] = {} if memoize else None
        self.whole_memo: dict = {}  # the same, for the round that completes partials whole
        self.wish_memo: Optional[dict] = {} if memoize else None  # situation -> wishes passed on
        self.partial_memo: dict = {}  # (rule, factors, passthrough) -> the results' pending partial
        # (signature, factors, passthrough) -> (strategy, layout each operand needs or None
        # for a literal, result layouts): what writing the plan reads per op
        self.placements: dict = {}
        self.axes_memo: dict = {}  # (rule, factors) -> per-dim axes of its operands and results
        self.hints_memo: dict = {}  # (rule, result, hints) -> the hints that makes for its operands
        self.book = RuleBook()      # rules and strategies interned, signature ids: across the graphs it plans
        self.prices = Prices(cost, allow_reduce_scatter)   # the one price of a move
        self._contexts: dict = {}   # graph id -> its PlanContext: built once for all rounds
        # graph -> the modeled time of the plan kept for it (``plan_core.evaluate``)
        self.modeled: dict = {}

    def context(self, graph: Graph) -> PlanContext:
        """``graph``'s plan context (rules, signatures, maps, resident values, step end)."""
        ctx = self._contexts.get(id(graph))
        if ctx is None or ctx.graph is not graph:
            ctx = self._contexts[id(graph)] = PlanContext(graph, self.book, self.cost.kernels)
        return ctx

    def compute_times_of(self, graph: Graph) -> ComputeTimes:
        """What a strategy costs in compute on ``graph``'s mesh (``cost.ComputeTimes``)."""
        return self.context(graph).compute_times(self.cost, graph.mesh)

    def __call__(self, graph: Graph) -> Graph:
        seeds = {op: self._body_wishes(op, graph) for op in graph.ops if op.subgraphs}
        # ops whose layouts the program fixes (a user's shard_map) are seeded like a user mark
        seeds.update((op, FIXED[op.kind](op, graph.mesh)) for op in graph.ops if op.kind in FIXED)
        self._plan(graph, {op: s for op, s in seeds.items() if s})
        for op in graph.ops:
            for body, pins_in, pins_out in boundary_layouts(op, graph.mesh):
                body.pinned_inputs.update(pins_in)
                body.pinned_outputs.update(pins_out)
                self(body)
        return graph

    def _body_wishes(self, op: Op, graph: Graph) -> Optional[list]:
        """What shard() calls inside a loop/branch body say about its boundary:
        agreement-only propagation in the body, read back as factors of the op."""
        rule = rule_for(op)
        factors: list = [None] * rule.num_factors
        found = False
        for body, pairs in boundary_pairs(op):
            if not any(o.kind == CONSTRAINT and o.pinned is not None for o in body.ops):
                continue
            prop = Propagation(body, self)
            prop.seed()
            prop._drain()
            for side, n, _, v, lead in pairs:
                dims = prop.dims.get(v)
                if not dims:
                    continue
                dims = ([()] if lead else []) + list(dims)
                fs = rule.operands[n] if side == "operand" else rule.results[n]
                for f, axes in project(fs, dims, rule, graph.mesh).items():
                    used = {a for x in factors if x for a in x}
                    if factors[f] is None and (not axes or rule.shardable(f) and not used & set(axes)):
                        factors[f] = axes
                        found = True
        return factors if found else None

    def _plan(self, graph: Graph, seeds: dict) -> None:
        # A second round knows which values the first round reduces (a partial sum
        # completed) or gathers anyway, for some consumer; the value's other consumers
        # can then take that copy for free instead of carrying the partial further
        # (a second reduction later) or gathering something else. The cheaper of the
        # two plans is kept.
        wished = Propagation(graph, self, {}, seeds)
        wished.wish()                  # wishes do not depend on the round: travel once
        best, made, rounds = None, {}, 2
        for r in range(rounds):
            # the last round may take the wished state itself; earlier ones work on a copy
            # (kept whole where a round that completes partials whole may start from it too)
            prop = Propagation(graph, self, made, seeds, start=wished,
                               copy=r < rounds - 1 or self.whole_round)
            prop.settle()   # writes its plan into the graph
            needs = prop.needs()
            cost = prop.plan_cost()
            if best is None or cost < best[0] - 1e-12:
                # (read now: the graph holds this round's layouts until another round writes)
                best = (cost, prop, self.whole_round and prop.scattered_partials(needs) and prop.moves(needs))
            now = prop.made_anyway(needs)
            if now == made or not prop.carried_elsewhere(now):
                break
            made = now
        if best[2]:
            # A choice settles one op: at a pending partial, a reduce_scatter onto a dim
            # and an all_reduce cost one collective each there, and what the scattered
            # layout costs further down (the next matmul contracting it and leaving a
            # partial of its own) is beyond that choice. So the whole plan is priced once
            # more with every partial passed on or completed whole, and kept where it moves
            # data fewer times and costs less: where collective latency dominates, the seed
            # network's one all_reduce beats two reduce_scatters. MindSpore's form (no fused
            # reduce_scatter) keeps the document's plan, settled op by op.
            prop = Propagation(graph, self, {}, seeds, start=wished, copy=True)
            prop.scatter_partials = False
            prop.settle()
            needs = prop.needs()
            cost = prop.plan_cost()
            if cost < best[0] - 1e-12 and prop.moves(needs) < best[2]:
                note = (f" (its partial all-reduced whole, not scattered: the whole plan then models "
                        f"{cost * 1e6:.1f} us in {_moves(prop.moves(needs))} against {best[0] * 1e6:.1f} us in "
                        f"{_moves(best[2])})")
                for (v, need), ops in needs.items():
                    if v.layout.partial and not need.partial and not set(v.layout.partial) & set(need.sharded_axes()):
                        for op in ops:
                            if op is not None:
                                op.origin = functools.partial(_noted, op.__dict__.get("_origin"), note)
                self.modeled[graph] = cost
                return   # its plan is in the graph
        if best[1] is not prop:
            best[1].write_plan()   # an earlier round was cheaper: its plan goes back in
        self.modeled[graph] = best[0]


def _moves(n: int) -> str:
    return f"{n} redistribution" + ("s" if n != 1 else "")


def _noted(origin, note: str) -> str:
    return (origin if isinstance(origin, str) else origin()) + note


