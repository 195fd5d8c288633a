"""The propagation engine: per-op factor decisions and per-value layouts.

State: for every op, its factors' axes (None while open) and the partial that may
pass through it; for every value, its per-dim axes (decided by its producer, or
wished by neighbours), its consumers' hints and its pending partial.

Phases: ``seed`` fixes what the user pinned; ``_drain`` passes wishes around
(agreement only, nothing decided); ``run`` then settles every op in program
order, so each choice sees its operands as produced and its consumers' wishes.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

from ..ir.graph import CONSTRAINT, Graph, Op, Value
from ..ir.layout import Layout

from .propagation_choice import ChoiceMixin, Source
from .propagation_plan import PlanMixin
from .plan_core.write import USER, in_strategy, out_strategy
from .propagation_wishes import WishMixin, fill_open
from .rules.base import FactorRule
from .sharding import dim_axes, factors_from_operands, project, result_partial


_OPEN = object()   # a passthrough not decided yet


class _ByDownstream(dict):
    """A memo entry whose choice read the open consumers' state: that state -> outcome."""


class Propagation(WishMixin, ChoiceMixin, PlanMixin):
    def __init__(self, graph: Graph, cfg, made: Optional[dict] = None,
                 seeds: Optional[dict] = None, start: Optional["Propagation"] = None, copy: bool = True):
        """``start``: carry on from that propagation's state (copied, unless ``copy``
        is False and ``start`` is not used again)."""
        self.g = graph
        # value -> {layout the last round reduced or gathered it to anyway: the ops that needed it}
        self.made = {v: {layout: frozenset(ops) for layout, ops in ls.items()} for v, ls in (made or {}).items()}
        self.seeds = seeds or {}       # loop op -> factors its body's shard() calls imply
        self.mesh = graph.mesh
        self.cfg = cfg
        self.ctx = cfg.context(graph)   # what the graph is, built once for every round
        self.rules: dict[Op, FactorRule] = self.ctx.rules
        self.signature: dict[Op, int] = self.ctx.signatures
        self.producer, self.users = self.ctx.producers, self.ctx.users
        self.queue: deque = deque()
        self.queued: set = set()
        self.wishing = False   # in the wish phase (``soft`` counts only there)
        self._down_cache: tuple = (None, ())   # (op being settled, its _downstream)
        self.read_downstream = False   # did settling this op read its consumers' state?
        # False: a pending partial is passed on or completed whole, never scattered onto a
        # dim (the round that asks whether fewer collectives make a cheaper whole plan)
        self.scatter_partials = True
        if start is not None:
            for name in self._STATE:
                d = getattr(start, name)
                if copy:   # lists are changed in place; everything else is replaced whole
                    d = {k: list(v) for k, v in d.items()} if name in self._LISTS else dict(d)
                setattr(self, name, d)
            self.soft = start.soft   # read only while wishing, and wishing is over
            return
        self.factors: dict[Op, list] = {op: [None] * r.num_factors for op, r in self.rules.items()}
        self.passthrough: dict[Op, Optional[tuple]] = {}
        # per value, per dim (tuples, replaced on every change, so they can go
        # straight into memo keys):
        self.dims: dict[Value, tuple] = {}   # axes if known (decided, or wished)
        self.hints: dict[Value, tuple] = {}  # what its consumers ask for
        self.taken: dict[Value, list] = {}   # graph input -> per dim, as its first deciding consumer takes it
        self.setter: dict[Value, tuple] = {}  # (how, the op or words) that decided a value's dims, for origins
        self.partial: dict[Value, tuple] = {}
        # value -> dims that only a wish made whole: a wish to split them still wins
        # (a replicated operand pinned near the end must not out-run, by being closer,
        # the split that the program's first op pins and that flows all the way there)
        self.soft: dict[Value, frozenset] = {}
        self.origin: dict[Op, object] = {op: op.origin for op in graph.ops if op.origin}

    _STATE = ("factors", "passthrough", "dims", "hints", "taken", "setter", "partial", "origin")
    _LISTS = ("factors", "taken")

    # -- helpers ----------------------------------------------------------------
    def _dims(self, v: Value) -> tuple:
        d = self.dims.get(v)
        return d if d is not None else (None,) * v.type.rank

    def _enqueue(self, op: Optional[Op], skip: Optional[Op] = None) -> None:
        if op is not None and op is not skip and op not in self.queued:
            self.queued.add(op)
            self.queue.append(op)

    # -- driver -----------------------------------------------------------------
    def seed(self) -> None:
        """What is fixed before anything propagates: pinned inputs and outputs,
        user constraints, ops inside shard() regions, loops with annotated bodies."""
        g = self.g
        for i, layout in g.pinned_inputs.items():
            v = g.inputs[i]
            self.dims[v] = tuple(layout.dims)
            name = g.input_names[i] if i < len(g.input_names) else f"#{i}"
            self.setter[v] = ("input", in_strategy(name) if g.name != "body" else "loop boundary")
            for u in self.users.get(v, []):
                self._enqueue(u)
        tied = {i: Layout(tuple(self.dims[g.inputs[j]])) for i, j in g.tied_outputs.items()
                if g.inputs[j] in self.dims}   # state whose input layout is pinned already
        for i, layout in {**tied, **g.pinned_outputs}.items():
            v = g.outputs[i]
            if v not in self.dims and not v.is_literal:
                self.dims[v] = tuple(layout.dims)
                self.hints[v] = tuple(layout.dims)
                self.setter[v] = ("consumer", out_strategy(i) if g.name != "body" else "loop boundary")
                self._enqueue(self.producer.get(v))
        for op in g.ops:
            if op.kind == CONSTRAINT and op.pinned is not None:
                # read through the rule: a size-1 dim has no factor, so dims and factors differ in number
                factors, _ = factors_from_operands(self.rules[op], op, [op.pinned], self.mesh)
                self._decide(op, factors, None, USER)
        for op in g.ops:
            if op.region is not None and op.kind != CONSTRAINT:
                # the user's strategy is what the shard() marks pin; other operands adapt
                layouts = [self._known_layout(v) if self._is_pinned_mark(self.producer.get(v)) else None
                           for v in op.inputs]
                factors, _ = factors_from_operands(self.rules[op], op, layouts, self.mesh)
                self._decide(op, factors, None, USER)
        for op, factors in self.seeds.items():
            self._decide(op, factors, None, f"from shard() inside the {op.kind} body")

    def run(self) -> None:
        self.wish()
        self.settle()

    def wish(self) -> None:
        """Phase one: pin what the user fixed and let wishes travel (nothing else is decided)."""
        g = self.g
        self.seed()
        if self.cfg.mode == "semi_auto":
            for op in g.ops:
                if op.origin != USER and not (op.kind == CONSTRAINT and op.pinned is not None):
                    self._decide(op, self._data_parallel_default(op), None, "default (data parallel)")
        self.wishing = True
        self._drain()
        if self._tie_free_state():
            self._drain()
        self.wishing = False

    def settle(self) -> None:
        """Phase two: decide every op in program order, then write strategies and layouts."""
        g = self.g
        # Settle the rest in program order: producers before consumers, so every
        # pending partial is known when its consumer chooses how to resolve it,
        # and what consumers wish (agreed backwards above) is known as hints.
        for op in g.ops:
            self._settle_op(op)
            if self.queue:
                self._drain()
        self.write_plan()

    def _settle_op(self, op: Op) -> None:
        """Decide everything still open at this op: from its neighbours if they say
        something (the cheapest candidate), else the default (whole)."""
        cur = self.factors[op]
        if None not in cur and op in self.passthrough:
            return
        rule = self.rules[op]
        if op.kind == CONSTRAINT and op.pinned is None:
            self._alias(op, rule)
            return
        self._down_cache = (None, ())   # read afresh: the state has moved on since
        # The choice, and what taking it writes, depend only on the situation:
        # repeated layers meet the same situations again and again, so each is
        # worked out once. What the open consumers' other operands are is part of
        # the situation only where the choice read it (pricing a hint, rarely):
        # such entries hold one outcome per state of those consumers.
        memo = self.cfg.memo
        if memo is not None and not self.scatter_partials:
            memo = self.cfg.whole_memo
        if memo is None:
            outcome = self._outcome(op, rule, cur)
        else:
            key = self._situation(op, cur)
            outcome = memo.get(key)
            if outcome is None:
                self.read_downstream = False
                outcome = self._outcome(op, rule, cur)
                memo[key] = _ByDownstream({self._downstream_key(op): outcome}) if self.read_downstream else outcome
            elif type(outcome) is _ByDownstream:
                by = outcome
                outcome = by.get(self._downstream_key(op))
                if outcome is None:
                    outcome = by[self._downstream_key(op)] = self._outcome(op, rule, cur)
        self._take(op, outcome)

    def _outcome(self, op: Op, rule: FactorRule, cur: list) -> tuple:
        """(factors, passthrough, lead, what to write into operands, into results):
        the cheapest candidate if some neighbour says something, factors nobody
        constrains whole. Nothing is written here."""
        choice = self._choose(op, rule, cur)
        factors = tuple(a if a is not None else (tuple(choice[0][f]) if choice and choice[0][f] is not None else ())
                        for f, a in enumerate(cur))
        passthrough = self.passthrough[op] if op in self.passthrough else (choice[1] if choice else None)
        return (factors, passthrough, choice[2] if choice else None) + self._writes(op, rule, factors, passthrough)

    def _take(self, op: Op, outcome: tuple) -> None:
        """Write an outcome into the state, and queue the neighbours that now hear more."""
        factors, passthrough, lead, to_operands, to_results = outcome
        self.factors[op][:] = factors
        if op not in self.passthrough:
            self.passthrough[op] = passthrough
        if not self.origin.get(op):
            self.origin[op] = self._origin_from(op, lead)
        self._write(op, to_operands, to_results)

    def _writes(self, op: Op, rule: FactorRule, factors, passthrough) -> tuple:
        """What deciding ``factors`` (None where still open) writes, worked out from
        the state without changing it: per operand, (dims, hints, changed?, axes) or
        None; per result, (dims, changed?, pending partial or None). ``passthrough``
        is _OPEN while undecided (no result partial is known then)."""
        operand_axes, result_axes = self._tensor_axes(rule, factors)
        # operands learn what this op wants, where nobody has said yet (in order: an
        # operand may come twice)
        dims, hints = {}, {}
        to_operands = []
        for v, axes in zip(op.inputs, operand_axes):
            if not axes or v.literal is not None:
                to_operands.append(None)
                continue
            old_hints = hints.get(v, self.hints.get(v))
            new_hints = axes if old_hints is None else fill_open(old_hints, axes)
            old = dims.get(v, self.dims.get(v))
            new = axes if old is None else fill_open(old, axes)
            changed = new != old and (old is not None or any(a is not None for a in new))
            hints[v], dims[v] = new_hints, new
            to_operands.append((new, new_hints, changed, axes))
        # results are what this op makes
        partial_known = passthrough is not _OPEN and all(factors[f] is not None for f in rule.reduction)
        to_results = []
        for v, axes in zip(op.outputs, result_axes):
            old = self.dims.get(v)
            new = axes if old is None else tuple(d if a is None else a for d, a in zip(old, axes))
            changed = new != old and (old is not None or any(a is not None for a in new))
            partial = (self._result_partial(rule, factors, passthrough)
                       if partial_known and v not in self.partial else None)
            to_results.append((new, changed, partial))
        return tuple(to_operands), tuple(to_results)

    def _write(self, op: Op, to_operands: tuple, to_results: tuple) -> None:
        for v, effect in zip(op.inputs, to_operands):
            if effect is None:
                continue
            dims, hints, changed, axes = effect
            self.hints[v] = hints
            self.dims[v] = dims
            if changed:
                self.setter.setdefault(v, ("consumer", op))
                self._enqueue(self.producer.get(v), op)
                for u in self.users.get(v, ()):
                    self._enqueue(u, op)
            if v not in self.producer:
                taken = self.taken.setdefault(v, [None] * v.type.rank)
                for d, a in enumerate(axes):
                    if taken[d] is None:
                        taken[d] = a
        for v, (dims, changed, partial) in zip(op.outputs, to_results):
            self.dims[v] = dims
            if changed:
                self.setter[v] = ("producer", op)
            if partial is not None and v not in self.partial:
                self.partial[v] = partial
                changed = changed or bool(partial[0])
            if changed:
                for u in self.users.get(v, ()):
                    self._enqueue(u, op)

    @staticmethod
    def _is_pinned_mark(op: Optional[Op]) -> bool:
        return op is not None and op.kind == CONSTRAINT and op.pinned is not None

    def _known_layout(self, v: Value) -> Optional[Layout]:
        d = self.dims.get(v)
        if d is None or any(a is None for a in d):
            return None
        return Layout(tuple(d))

    def _drain(self) -> None:
        while self.queue:
            op = self.queue.popleft()
            self.queued.discard(op)
            self._visit(op)

    def _data_parallel_default(self, op: Op) -> list:
        """MindSpore's default: the first dim of the first operand (or of the result,
        if that operand is a scalar) split over every device, where it divides."""
        rule = self.rules[op]
        factors = [()] * rule.num_factors
        dims = rule.operands[0] if rule.operands and rule.operands[0] else (rule.results[0] if rule.results else ())
        if dims and dims[0]:
            f = dims[0][0]
            if rule.shardable(f) and rule.sizes[f] % self.mesh.size == 0:
                factors[f] = self.mesh.axis_names
        return factors

    # -- one op -----------------------------------------------------------------
    def _sources(self, op: Op, rule: FactorRule, hush_soft: bool = False) -> list[Source]:
        """What each operand and result says about this op's factors (``hush_soft``:
        dims only a wish made whole say nothing)."""
        said = self._said if hush_soft else self.dims.__getitem__
        out = []
        for n, v in enumerate(op.inputs):
            fs = rule.operands[n]
            if fs is None or v.type.rank == 0 or v not in self.dims:
                continue
            prop = project(fs, said(v), rule, self.mesh)
            if prop:
                out.append(Source("operand", n, v, prop))
        for n, v in enumerate(op.outputs):
            if v not in self.dims or v.type.rank == 0:
                continue
            prop = project(rule.results[n], said(v), rule, self.mesh)
            if prop:
                out.append(Source("result", n, v, prop))
        return out

    def _neighbours(self, op: Op, rule: FactorRule, cur: list, hush_soft: bool = False) -> tuple:
        """(every neighbour's proposal, those about an open factor, operands with a
        pending partial); sources None when nothing is said that this op could act on."""
        open_factors = [f for f, a in enumerate(cur) if a is None]
        sources = self._sources(op, rule, hush_soft)
        useful = [s for s in sources if any(f in s.proposal for f in open_factors)]
        partial_operands = [n for n, v in enumerate(op.inputs) if self.partial.get(v, ((), "sum"))[0]
                            and rule.operands[n] is not None]
        if not useful and not (partial_operands and op not in self.passthrough and any(
                self.dims.get(v) for v in op.inputs)):
            return None, useful, partial_operands
        return sources, useful, partial_operands

    def _choose(self, op: Op, rule: FactorRule, cur: list) -> Optional[tuple]:
        """The settling choice at this op: (factors, passthrough, lead as (side, index)),
        or None when no neighbour says anything about its open factors."""
        sources, useful, partial_operands = self._neighbours(op, rule, cur)
        if sources is None:
            return None
        best = self._best_candidate(op, rule, cur, useful or sources, partial_operands)
        if best is None:
            return None
        factors, passthrough, lead = best
        return tuple(factors), passthrough, (lead.kind, lead.index) if lead is not None else None

    def _alias(self, op: Op, rule: FactorRule) -> None:
        """A shard() output mark without an out_strategy only delimits the region:
        its value passes through exactly as produced, pending partial included."""
        v = op.inputs[0]
        dims = self.dims.get(v) or (None,) * v.type.rank
        factors = list(self.factors[op])
        for fs, axes in zip(rule.operands[0], dims):
            for f in fs:
                if factors[f] is None:
                    factors[f] = axes if axes is not None else ()
        axes, pop = self.partial.get(v, ((), "sum"))
        group = next((gi for gi, (g, gop) in enumerate(rule.linear) if gop == pop), None)
        passthrough = (group, axes) if axes and group is not None else None
        self._decide(op, factors, passthrough, self._origin_from(op, ("operand", 0)))

    def _tensor_axes(self, rule: FactorRule, factors: list) -> tuple:
        """Per operand and per result, per dim: the axes these factors give it (None
        where a factor is open or the combination is invalid; None for an operand
        that takes no part). Worked out once per rule and factors."""
        key = (id(rule), tuple(factors))
        memo = self.cfg.axes_memo
        out = memo.get(key)
        if out is None:
            out = memo[key] = (
                tuple(None if fs is None else tuple(self._safe_dim_axes(d, factors, rule) for d in fs)
                      for fs in rule.operands),
                tuple(tuple(self._safe_dim_axes(d, factors, rule) for d in fs) for fs in rule.results))
        return out

    def _result_partial(self, rule: FactorRule, factors: list, passthrough) -> tuple:
        if not rule.reduction and passthrough is None:
            return (), rule.reduce_op or "sum"
        key = (id(rule), tuple(factors), passthrough)
        out = self.cfg.partial_memo.get(key)
        if out is None:
            out = self.cfg.partial_memo[key] = result_partial(rule, factors, passthrough, self.mesh)
        return out

    # -- committing a decision --------------------------------------------------
    def _decide(self, op: Op, factors: list, passthrough, origin: str) -> None:
        """Fix what ``factors`` says (None: still open) at this op, for good."""
        cur = self.factors[op]
        if None in cur:
            for f, a in enumerate(factors):
                if cur[f] is None and a is not None:
                    cur[f] = a if type(a) is tuple else tuple(a)
        if op not in self.passthrough and (passthrough is not None or None not in cur or origin == USER):
            self.passthrough[op] = passthrough
        if not self.origin.get(op):
            self.origin[op] = origin
        self._write(op, *self._writes(op, self.rules[op], cur, self.passthrough.get(op, _OPEN)))

    def _safe_dim_axes(self, fs, cur, rule):
        try:
            return dim_axes(fs, cur, rule, self.mesh)
        except ValueError:
            return None
