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

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

from ir.graph import CONSTRAINT, Graph, Op, Value
from ir.layout import Layout

from .cost import DEFAULT_COST, CostModel
from .redistribute import redistribution_cost
from .rules import rule_for
from .rules.base import FactorRule
from .sharding import Axes, OpStrategy, dim_axes, factors_from_operands, project

IMPOSSIBLE = 1e6  # seconds: a candidate that needs a redistribution that cannot exist


@dataclass
class _Source:
    kind: str            # "operand" or "result"
    index: int
    value: Value
    proposal: dict       # factor -> axes


class PropagateSharding:
    name = "propagate-sharding"

    def __init__(self, mode: str = "sharding_propagation", cost: CostModel = DEFAULT_COST,
                 allow_reduce_scatter: bool = True):
        if mode not in ("sharding_propagation", "semi_auto"):
            raise ValueError(f"unknown propagation mode {mode!r}")
        self.mode = mode
        self.cost = cost
        self.allow_reduce_scatter = allow_reduce_scatter
        self.memo: dict = {}   # situation at an op -> the choice made there

    def __call__(self, graph: Graph) -> Graph:
        seeds = {op: self._body_wishes(op, graph) for op in graph.ops if op.subgraphs}
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
            prop = _Propagation(body, self)
            prop.seed()
            prop._drain()
            for side, n, v, lead in pairs:
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
        # A second round knows which partial values the first round reduces anyway
        # (for some consumer); their other consumers can then take the reduced value
        # for free instead of carrying the partial further (which would need a second
        # reduction later). The cheaper of the two plans is kept.
        initial = {op: op.origin for op in graph.ops}
        best, reduced = None, {}
        for _ in range(2):
            for op in graph.ops:
                op.origin = initial[op]
            prop = _Propagation(graph, self, reduced, seeds)
            prop.run()
            needs = prop.needs()
            cost = prop.plan_cost(needs)
            if best is None or cost < best[0] - 1e-12:
                best = (cost, prop.snapshot())
            now = prop.reduced_values(needs)
            if now == reduced or not prop.carried_elsewhere(now):
                break
            reduced = now
        _restore(graph, best[1])
        sink_reductions(graph)


def sink_reductions(graph: Graph) -> None:
    """Move an all_reduce past a linear op that is its value's only user and makes
    nothing bigger: ``add(AR(a), AR(b))`` becomes ``AR(add(a, b))``, one reduction
    instead of two (the two gradient contributions of a tied embedding, say).
    Neutral where nothing merges, so it is only a rewrite, never a loss."""
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


def boundary_pairs(op: Op):
    """For each body of a loop/branch op: (side, index of the op's operand/result,
    body value, whether the op's tensor has a leading iteration dim)."""
    if op.kind == "scan":
        body = op.subgraphs[0]
        nc, ncarry = op.params["num_consts"], op.params["num_carry"]
        pairs = [("operand", i, v, i >= nc + ncarry) for i, v in enumerate(body.inputs)]
        pairs += [("result", i, v, i >= ncarry) for i, v in enumerate(body.outputs)]
        yield body, pairs
    elif op.kind == "while":
        cond, body = op.subgraphs
        nc, nb = op.params["cond_nconsts"], op.params["body_nconsts"]
        carry = len(body.outputs)
        yield cond, [("operand", i, v, False) for i, v in enumerate(cond.inputs[:nc])] + \
            [("operand", nc + nb + i, v, False) for i, v in enumerate(cond.inputs[nc:])]
        yield body, [("operand", nc + i, v, False) for i, v in enumerate(body.inputs)] + \
            [("result", i, v, False) for i, v in enumerate(body.outputs[:carry])]
    elif op.kind == "cond":
        for b in op.subgraphs:
            yield b, [("operand", i + 1, v, False) for i, v in enumerate(b.inputs)] + \
                [("result", i, v, False) for i, v in enumerate(b.outputs)]


def boundary_layouts(op: Op, mesh):
    """The layouts a body's inputs arrive in and its outputs must leave in, from the
    op's strategy (a while's condition returns a replicated scalar)."""
    for body, pairs in boundary_pairs(op):
        pins_in, pins_out = {}, {}
        for side, n, v, lead in pairs:
            if side == "operand":
                layout = op.strategy.operand_layout(n, op.inputs[n].type.rank, mesh)
            else:
                layout = op.strategy.result_layout(n, mesh)
            layout = Layout(layout.dims[1:] if lead else layout.dims)
            index = (body.inputs if side == "operand" else body.outputs).index(v)
            (pins_in if side == "operand" else pins_out)[index] = layout
        if op.kind == "while" and body is op.subgraphs[0]:
            pins_out[0] = Layout(())
        yield body, pins_in, pins_out


def _restore(graph: Graph, snap) -> None:
    ops, values = snap
    for op in graph.ops:
        op.strategy, op.origin = ops[op]
    for v in graph.values():
        if v in values:
            v.layout = values[v]


class _Propagation:
    def __init__(self, graph: Graph, cfg: PropagateSharding, reduced: Optional[dict] = None,
                 seeds: Optional[dict] = None):
        self.g = graph
        self.reduced = reduced or {}   # value -> layouts a reshard of it makes anyway
        self.seeds = seeds or {}       # loop op -> factors its body's shard() calls imply
        self.mesh = graph.mesh
        self.cfg = cfg
        self.rules: dict[Op, FactorRule] = {op: rule_for(op) for op in graph.ops}
        self.factors: dict[Op, list] = {op: [None] * r.num_factors for op, r in self.rules.items()}
        self.passthrough: dict[Op, Optional[tuple]] = {}
        self.dims: dict[Value, list] = {}    # per value, per dim: axes if known (decided, or wished)
        self.hints: dict[Value, list] = {}   # per value, per dim: what its consumers ask for
        self.taken: dict[Value, list] = {}   # graph input -> per dim, as its first deciding consumer takes it
        self.setter: dict[Value, str] = {}   # who decided a value's dims (for origins)
        self.partial: dict[Value, tuple] = {}
        self.origin: dict[Op, str] = {op: op.origin for op in graph.ops if op.origin}
        self.producer = graph.producers()
        self.users = graph.users()
        self.queue: deque = deque()
        self.queued: set = set()
        self.order = {op: i for i, op in enumerate(graph.ops)}

    # -- helpers ----------------------------------------------------------------
    def _dims(self, v: Value) -> list:
        d = self.dims.get(v)
        if d is None:
            d = self.dims[v] = [None] * v.type.rank
        return d

    def _enqueue(self, op: Optional[Op], skip: Optional[Op] = None) -> None:
        if op is not None and op is not skip and op not in self.queued:
            self.queued.add(op)
            self.queue.append(op)

    def _describe(self, op: Op) -> str:
        kind = op.kind
        if op.kind == CONSTRAINT and op.region is not None and op.region in self.g.regions:
            kind = self.g.regions[op.region].describe()
        return f"{kind} at {op.source}" if op.source else kind

    # -- driver -----------------------------------------------------------------
    def seed(self) -> None:
        """What is fixed before anything propagates: pinned inputs and outputs,
        user constraints, ops inside shard() regions, loops with annotated bodies."""
        g = self.g
        for i, layout in g.pinned_inputs.items():
            v = g.inputs[i]
            self.dims[v] = list(layout.dims)
            name = g.input_names[i] if i < len(g.input_names) else f"#{i}"
            self.setter[v] = ("input", f"in_strategy of input {name}" if g.name != "body" else "loop boundary")
            for u in self.users.get(v, []):
                self._enqueue(u)
        tied = {i: Layout(tuple(self.dims[g.inputs[j]])) for i, j in g.tied_outputs.items()
                if g.inputs[j] in self.dims}   # state whose input layout is pinned already
        for i, layout in {**tied, **g.pinned_outputs}.items():
            v = g.outputs[i]
            if v not in self.dims and not v.is_literal:
                self.dims[v] = list(layout.dims)
                self.hints[v] = list(layout.dims)
                self.setter[v] = ("consumer", f"out_strategy of output {i}" if g.name != "body" else "loop boundary")
                self._enqueue(self.producer.get(v))
        for op in g.ops:
            if op.kind == CONSTRAINT and op.pinned is not None:
                self._decide(op, list(op.pinned.dims), None, "user")
        for op in g.ops:
            if op.region is not None and op.kind != CONSTRAINT:
                # the user's strategy is what the shard() marks pin; other operands adapt
                layouts = [self._known_layout(v) if self._is_pinned_mark(self.producer.get(v)) else None
                           for v in op.inputs]
                factors, _ = factors_from_operands(self.rules[op], op, layouts, self.mesh)
                self._decide(op, factors, None, "user")
        for op, factors in self.seeds.items():
            self._decide(op, factors, None, f"from shard() inside the {op.kind} body")

    def run(self) -> None:
        g = self.g
        self.seed()
        if self.cfg.mode == "semi_auto":
            for op in g.ops:
                if op.origin != "user" and not (op.kind == CONSTRAINT and op.pinned is not None):
                    self._decide(op, self._data_parallel_default(op), None, "default (data parallel)")
        self._drain()
        # Settle the rest in program order: producers before consumers, so every
        # pending partial is known when its consumer chooses how to resolve it,
        # and what consumers wish (agreed backwards above) is known as hints.
        for op in g.ops:
            self._visit(op, settle=True)
            f = self.factors[op]
            if any(a is None for a in f) or op not in self.passthrough:  # unconstrained: stays whole
                self._decide(op, [a if a is not None else () for a in f], None, self.origin.get(op) or "default")
            self._drain()
        self._finish()

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
    def _sources(self, op: Op, rule: FactorRule) -> list[_Source]:
        out = []
        for n, v in enumerate(op.inputs):
            fs = rule.operands[n]
            if fs is None or v.type.rank == 0 or v not in self.dims:
                continue
            prop = project(fs, self.dims[v], rule, self.mesh)
            if prop:
                out.append(_Source("operand", n, v, prop))
        for n, v in enumerate(op.outputs):
            if v not in self.dims or v.type.rank == 0:
                continue
            prop = project(rule.results[n], self.dims[v], rule, self.mesh)
            if prop:
                out.append(_Source("result", n, v, prop))
        return out

    def _visit(self, op: Op, settle: bool = False) -> None:
        """Decide what the neighbours say about this op's open factors. Unless
        ``settle``, only uncontested decisions are taken: every neighbour that says
        something agrees and no pending partial must be resolved."""
        rule = self.rules[op]
        cur = self.factors[op]
        open_factors = [f for f, a in enumerate(cur) if a is None]
        if not open_factors and op in self.passthrough:
            return
        if settle and op.kind == CONSTRAINT and op.pinned is None:
            self._alias(op, rule)
            return
        sources = self._sources(op, rule)
        useful = [s for s in sources if any(f in s.proposal for f in open_factors)]
        partial_operands = [n for n, v in enumerate(op.inputs) if self.partial.get(v, ((), "sum"))[0]
                            and rule.operands[n] is not None]
        if not useful and not (partial_operands and op not in self.passthrough and any(
                self.dims.get(v) for v in op.inputs)):
            return
        if not settle:
            # Before settling, only wishes travel: what the neighbours agree on is passed
            # on to the other neighbours' unknown dims, and nothing is decided yet.
            if not self._contested(cur, useful):
                self._wish(op, rule, cur, useful)
            return
        best = self._best_candidate(op, rule, cur, useful or sources, partial_operands)
        if best is None:
            return
        factors, passthrough, lead = best
        self._decide(op, factors, passthrough, self._origin_from(lead))

    def _alias(self, op: Op, rule: FactorRule) -> None:
        """A shard() output mark without an out_strategy only delimits the region:
        its value passes through exactly as produced, pending partial included."""
        v = op.inputs[0]
        dims = self.dims.get(v) or [None] * v.type.rank
        factors = list(self.factors[op])
        for fs, axes in zip(rule.operands[0], dims):
            for f in fs:
                if factors[f] is None:
                    factors[f] = axes if axes is not None else ()
        axes, pop = self.partial.get(v, ((), "sum"))
        group = next((gi for gi, (g, gop) in enumerate(rule.linear) if gop == pop), None)
        passthrough = (group, axes) if axes and group is not None else None
        self._decide(op, factors, passthrough, self._origin_from(_Source("operand", 0, v, {})))

    @staticmethod
    def _contested(cur: list, sources: list[_Source]) -> bool:
        """Do two neighbours propose different axes for an open factor?"""
        seen: dict[int, Axes] = {}
        for s in sources:
            for f, axes in s.proposal.items():
                if cur[f] is None and seen.setdefault(f, axes) != axes:
                    return True
        return False

    def _origin_from(self, lead: Optional[_Source]) -> str:
        if lead is None:
            return "default"
        how, who = self.setter.get(lead.value, ("", "?"))
        if lead.kind == "result" or how == "consumer":
            return f"backward from {who}"
        if how == "producer":
            return f"forward from {who}"
        return f"from {who}"

    def _complete(self, rule: FactorRule, base: list, ordered: list[_Source], reserved=()) -> list:
        cand = list(base)
        used = {a for axes in cand if axes for a in axes} | set(reserved)
        for s in ordered:
            for f, axes in s.proposal.items():
                if cand[f] is not None:
                    continue
                if axes and (not rule.shardable(f) or rule.sizes[f] % self.mesh.axes_size(axes)
                             or used.intersection(axes)):
                    continue
                cand[f] = axes
                used.update(axes)
        return cand

    def _situation(self, op, rule, cur, sources, partial_operands) -> tuple:
        """Everything the choice at this op depends on. Repeated layers meet the same
        situation again and again, so the choice is computed once per situation."""
        def value_state(v):
            d = self.dims.get(v)
            return (v.type, tuple(d) if d is not None else None, self.partial.get(v),
                    frozenset(self.reduced.get(v, ())))
        return (rule, tuple(cur), self.passthrough.get(op, "open"),
                tuple((s.kind, s.index, tuple(sorted(s.proposal.items()))) for s in sources),
                tuple(partial_operands), tuple(value_state(v) for v in op.inputs),
                tuple(value_state(v) for v in op.outputs))

    def _best_candidate(self, op, rule, cur, sources, partial_operands):
        key = self._situation(op, rule, cur, sources, partial_operands)
        memo = self.cfg.memo
        if key not in memo:
            best = self._best_candidate_uncached(op, rule, cur, sources, partial_operands)
            memo[key] = None if best is None else (best[0], best[1], sources.index(best[2]) if best[2] else None)
        hit = memo[key]
        if hit is None:
            return None
        c, pt, i = hit
        return list(c), pt, (sources[i] if i is not None else None)

    def _best_candidate_uncached(self, op, rule, cur, sources, partial_operands):
        mesh = self.mesh
        cands: list[tuple[list, Optional[tuple], Optional[_Source]]] = []
        pt_now = self.passthrough.get(op)
        reserved = pt_now[1] if pt_now else ()   # axes a decided passthrough partial already holds
        for i, s in enumerate(sources):
            cands.append((self._complete(rule, cur, [s] + sources[:i] + sources[i + 1:], reserved), None, s))
        if not sources:
            cands.append((list(cur), None, None))
        # what to do with pending partial operands
        extra = []
        decided_pt = op in self.passthrough
        for n in partial_operands:
            axes, pop = self.partial[op.inputs[n]]
            if not decided_pt:
                for gi, (group, gop) in enumerate(rule.linear):
                    if n not in group or gop != pop:
                        continue
                    if any(a and set(a) & set(axes) for a in cur):
                        continue  # a decided factor already holds one of the partial's axes
                    if all(self.partial.get(op.inputs[m], ((), "sum")) == (axes, pop) for m in group) and all(
                            not self.partial.get(op.inputs[m], ((), "sum"))[0]
                            for m in range(len(op.inputs)) if m not in group):
                        for c, _, s in cands:
                            cc = [a if a is None or not set(a) & set(axes) else None for a in c]
                            extra.append((cc, (gi, axes), s))
            # partial -> sharded: a reduce_scatter (or MindSpore's all_reduce + slice)
            if pop == "sum" and rule.operands[n]:
                for c, _, s in cands:
                    for fs in rule.operands[n]:
                        for f in fs:
                            if cur[f] is not None or c[f] is None:
                                continue
                            new = tuple(c[f]) + tuple(axes)
                            if set(c[f]) & set(axes) or not rule.shardable(f) or rule.sizes[f] % mesh.axes_size(new):
                                continue
                            if any(set(a) & set(axes) for g, a in enumerate(c) if g != f and a):
                                continue
                            cc = list(c)
                            cc[f] = new
                            extra.append((cc, None, s))
        cands += extra
        seen, scored = set(), []
        for idx, (c, pt, s) in enumerate(cands):
            key = (tuple(c), pt)
            if key in seen:
                continue
            seen.add(key)
            try:
                cost = self._cost(op, rule, c, pt if pt is not None else self.passthrough.get(op))
            except ValueError:
                continue
            # ties: more sharding first (less repeated work and memory), then axes spread over dims
            sharded = -sum(len(a) for a in c if a)
            balance = max((len(a) for a in c if a), default=0)
            scored.append((round(cost, 15), sharded, balance, idx, c, pt, s))
        if not scored:
            return None
        *_, c, pt, s = min(scored, key=lambda t: t[:4])
        return c, pt, s

    # -- costs ------------------------------------------------------------------
    def _layout_pair(self, have_dims, have_partial, want_dims, want_partial):
        hd, wd = [], []
        for h, w in zip(have_dims, want_dims):
            h2 = h if h is not None else (w if w is not None else ())
            w2 = w if w is not None else h2
            hd.append(h2)
            wd.append(w2)
        have = Layout(tuple(hd), have_partial[0], have_partial[1])
        want = Layout(tuple(wd), want_partial[0], want_partial[1])
        if len(set(have.sharded_axes() + have.partial)) != len(have.sharded_axes() + have.partial):
            have = Layout(tuple(h if h is not None else () for h in have_dims), have_partial[0], have_partial[1])
        if len(set(want.sharded_axes() + want.partial)) != len(want.sharded_axes() + want.partial):
            want = Layout(tuple(w if w is not None else () for w in want_dims), want_partial[0], want_partial[1])
        return have, want

    def _redistribution(self, v: Value, have: Layout, want: Layout) -> float:
        if want in self.reduced.get(v, ()):
            return 0.0
        if not set(want.partial) <= set(have.partial):
            return IMPOSSIBLE
        if not have.fits(v.type.shape, self.mesh) or not want.fits(v.type.shape, self.mesh):
            return IMPOSSIBLE
        return redistribution_cost(v.type.shape, v.type.itemsize, have, want, self.mesh,
                                   self.cfg.allow_reduce_scatter, self.cfg.cost)

    def _cost(self, op: Op, rule: FactorRule, cand: list, pt) -> float:
        mesh = self.mesh
        total = 0.0
        pt_group = rule.linear[pt[0]][0] if pt else ()
        pt_axes = mesh.sort_axes(pt[1]) if pt else ()
        pt_op = rule.linear[pt[0]][1] if pt else "sum"
        for n, v in enumerate(op.inputs):
            fs = rule.operands[n]
            if fs is None or v.type.rank == 0 and not self.partial.get(v, ((), ""))[0]:
                continue
            want = [dim_axes(d, cand, rule, mesh) for d in fs]
            want_partial = (pt_axes, pt_op) if n in pt_group else ((), "sum")
            have = self.dims.get(v) or [None] * v.type.rank
            have_partial = self.partial.get(v, ((), "sum"))
            h, w = self._layout_pair(have, have_partial, want, want_partial)
            total += self._redistribution(v, h, w)
        red_axes = [a for f in rule.reduction if cand[f] for a in cand[f]]
        res_partial = (mesh.sort_axes(red_axes + list(pt_axes)),
                       pt_op if pt else (rule.reduce_op or "sum"))
        for n, v in enumerate(op.outputs):
            hint = self.hints.get(v)
            if hint is None or all(h is None for h in hint):
                continue
            mine = [dim_axes(d, cand, rule, mesh) for d in rule.results[n]]
            h, w = self._layout_pair(mine, res_partial, hint, ((), "sum"))
            total += self._redistribution(v, h, w)
        degree = math.prod(mesh.axes_size(a) for a in cand if a)
        touched = sum(v.type.nbytes for v in itertools.chain(op.inputs, op.outputs))
        total += self.cfg.cost.compute_time(rule.flops / degree, touched / degree)
        return total

    def _wish(self, op: Op, rule: FactorRule, cur: list, sources: list[_Source]) -> None:
        """Fill the unknown dims of this op's operands and results with what its
        neighbours agree on, without deciding the op. What goes to one neighbour is
        made from the others only, so a value never hears its own wish echoed back."""
        for side, tensors, fss in (("operand", op.inputs, rule.operands), ("result", op.outputs, rule.results)):
            for n, (v, fs) in enumerate(zip(tensors, fss)):
                if fs is None or v.type.rank == 0 or v.is_literal or self._settled(v, side == "operand"):
                    continue
                others = [s for s in sources if not (s.kind == side and s.index == n)]
                if others:
                    self._fill(v, fs, self._complete(rule, cur, others), rule, op, side == "operand")

    def _settled(self, v: Value, from_consumer: bool) -> bool:
        """Nothing left to fill: every dim known (and, for a consumer's wish, hinted)."""
        dims = self.dims.get(v)
        if dims is None or None in dims:
            return False
        if from_consumer:
            hints = self.hints.get(v)
            return hints is not None and None not in hints
        return True

    def _fill(self, v: Value, fs, factors: list, rule: FactorRule, op: Op, from_consumer: bool) -> None:
        dims = self._dims(v)
        hints = self.hints.setdefault(v, [None] * v.type.rank) if from_consumer else None
        changed = False
        for d, dfs in enumerate(fs):
            a = self._safe_dim_axes(dfs, factors, rule)
            if a is None:
                continue
            if hints is not None and hints[d] is None:
                hints[d] = a
            if dims[d] is None:
                dims[d] = a
                changed = True
        if changed:
            self.setter.setdefault(v, ("consumer" if from_consumer else "producer", self._describe(op)))
            self._enqueue(self.producer.get(v), op)
            for u in self.users.get(v, []):
                self._enqueue(u, op)

    # -- committing a decision --------------------------------------------------
    def _decide(self, op: Op, factors: list, passthrough, origin: str) -> None:
        rule = self.rules[op]
        cur = self.factors[op]
        for f, a in enumerate(factors):
            if cur[f] is None and a is not None:
                cur[f] = tuple(a)
        if op not in self.passthrough and (passthrough is not None or all(a is not None for a in cur)
                                           or origin == "user"):
            self.passthrough[op] = passthrough
        if op not in self.origin or not self.origin[op]:
            self.origin[op] = origin
        me = self._describe(op)
        # operands learn what this op wants, where nobody has said yet
        for n, v in enumerate(op.inputs):
            fs = rule.operands[n]
            if fs is None or v.type.rank == 0 or v.is_literal:
                continue
            self._fill(v, fs, cur, rule, op, True)
            if v not in self.producer:
                taken = self.taken.setdefault(v, [None] * v.type.rank)
                for d, dfs in enumerate(fs):
                    if taken[d] is None:
                        taken[d] = self._safe_dim_axes(dfs, cur, rule)
        # results are what this op makes
        red_known = all(cur[f] is not None for f in rule.reduction)
        for n, v in enumerate(op.outputs):
            dims = self._dims(v)
            changed = False
            for d, dfs in enumerate(rule.results[n]):
                a = self._safe_dim_axes(dfs, cur, rule)
                if a is not None and dims[d] != a:
                    dims[d] = a
                    changed = True
            if changed:
                self.setter[v] = ("producer", me)
            if red_known and op in self.passthrough and v not in self.partial:
                st = OpStrategy(rule, tuple(a if a is not None else () for a in cur), self.passthrough[op])
                self.partial[v] = st.result_partial(self.mesh)
                changed = changed or bool(self.partial[v][0])
            if changed:
                for u in self.users.get(v, []):
                    self._enqueue(u, op)

    def _safe_dim_axes(self, fs, cur, rule):
        try:
            return dim_axes(fs, cur, rule, self.mesh)
        except ValueError:
            return None

    def snapshot(self):
        return ({op: (op.strategy, op.origin) for op in self.g.ops},
                {v: v.layout for v in self.g.values() if v.layout is not None})

    def needs(self):
        """(value, layout an op needs it in) for every operand that must be redistributed."""
        out = set()
        for op in self.g.ops:
            for n, v in enumerate(op.inputs):
                if v.is_literal:
                    continue
                need = op.strategy.operand_layout(n, v.type.rank, self.mesh)
                if need != v.layout:
                    out.add((v, need))
        for v in self.g.outputs:
            if v.layout is not None and v.layout.partial:
                out.add((v, v.layout.without_partial()))
        return out

    def carried_elsewhere(self, reduced: dict) -> bool:
        """Does some value that gets reduced reach another op in a different layout
        (still partial, or reduced differently)? Only then can a second round save
        a redistribution, by letting that op take the reduced value."""
        for v in reduced:
            wanted = {u.strategy.operand_layout(n, v.type.rank, self.mesh)
                      for u in self.users.get(v, []) for n, x in enumerate(u.inputs) if x is v}
            if len(wanted) > 1:
                return True
        return False

    def reduced_values(self, needs) -> dict:
        """Partial values some op all-reduces in place (same dims, sum completed)."""
        out: dict = {}
        for v, need in needs:
            if v.layout.partial and need == v.layout.without_partial():
                out.setdefault(v, set()).add(need)
        return out

    def plan_cost(self, needs) -> float:
        """Estimated time of the whole plan: every redistribution once, plus compute."""
        total = 0.0
        for v, need in needs:
            total += redistribution_cost(v.type.shape, v.type.itemsize, v.layout, need, self.mesh,
                                         self.cfg.allow_reduce_scatter, self.cfg.cost)
        for op in self.g.ops:
            degree = math.prod(self.mesh.axes_size(a) for a in op.strategy.factors if a)
            touched = sum(v.type.nbytes for v in itertools.chain(op.inputs, op.outputs))
            total += self.cfg.cost.compute_time(self.rules[op].flops / degree, touched / degree)
        return total

    def _finish(self) -> None:
        mesh = self.mesh
        for i, v in enumerate(self.g.inputs):
            # an input arrives as its first deciding consumer takes it (wishes are only wishes)
            dims = self._dims(v) if i in self.g.pinned_inputs else self.taken.get(v, self._dims(v))
            layout = Layout(tuple(a if a is not None else () for a in dims))
            if not layout.fits(v.type.shape, mesh):
                layout = Layout.replicated(v.type.rank)
            v.layout = layout
        for op in self.g.ops:
            rule = self.rules[op]
            st = OpStrategy(rule, tuple(self.factors[op]), self.passthrough.get(op))
            problems = st.problems(mesh)
            if problems:
                raise AssertionError(f"propagation produced an invalid strategy for {op.describe()}: {problems}")
            op.strategy = st
            op.origin = self.origin.get(op) or "default"
            for n, v in enumerate(op.outputs):
                v.layout = st.result_layout(n, mesh)
