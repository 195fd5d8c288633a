"""Choosing among candidate strategies at one op, and what a candidate costs.

A candidate assigns mesh axes to the op's factors (and maybe lets a pending
partial pass through a linear operand group). Its cost is the time to
redistribute every known operand into what the candidate needs, and its results
into what their consumers ask for, plus the op's own compute on each device, so
repeated (replicated) work counts. Choices are memoized per situation: repeated
layers meet the same situation again and again.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional

from ..ir.graph import Op, Value
from ..ir.layout import Layout

from .cost import wire_bytes
from .plan_core.improve import best_move
from .plan_core.write import DEFAULT
from .rules.base import FactorRule
from .sharding import Axes, dim_axes, keep_contiguous, may_shard, nesting, project, regroup



@dataclass
class Source:
    kind: str            # "operand" or "result"
    index: int
    value: Value
    proposal: dict       # factor -> axes


class ChoiceMixin:
    """Candidate generation and costing; mixed into the propagation state."""

    @staticmethod
    def _contested(cur: list, sources: list[Source]) -> bool:
        """Do two neighbours propose different axes for an open factor?"""
        seen: dict[int, Axes] = {}
        for s in sources:
            for f, axes in s.proposal.items():
                if cur[f] is None and seen.setdefault(f, axes) != axes:
                    return True
        return False

    def _origin_from(self, op: Op, lead: Optional[tuple]):
        """Where a choice led by (side, index) of this op came from: kept as
        (side, how, who) and put into words only for the plan that is kept."""
        if lead is None:
            return DEFAULT
        side, index = lead
        v = (op.inputs if side == "operand" else op.outputs)[index]
        how, who = self.setter.get(v, ("", "?"))
        if who is op:
            # the value learnt its layout from this op's own earlier wish: name whoever told
            # this op (another of its values, set by someone else), so chains reach a mark
            values = [("operand", u) for u in op.inputs] + [("result", u) for u in op.outputs]
            for other_side, u in values:
                other = self.setter.get(u)
                if other is not None and other[1] is not op:
                    return other_side, other[0], other[1]
        return side, how, who

    def _complete(self, rule: FactorRule, base: list, ordered: list[Source], reserved=()) -> list:
        """``base`` with its open factors taken from the sources, in order, where the
        rule allows: a split must divide its factor, use free axes, and (in a dim of
        several factors) sit only under fully split major factors, so every tensor's
        blocks stay contiguous. Majors are taken first so that a minor can follow."""
        cand = list(base)
        used = {a for axes in cand if axes for a in axes} | set(reserved)
        depth = nesting(rule).depth
        mesh = self.mesh
        for s in ordered:
            items = s.proposal.items()
            if depth:
                items = sorted(items, key=lambda item: depth.get(item[0], 0))
            for f, axes in items:
                if cand[f] is not None:
                    continue
                if axes and (not rule.shardable(f) or rule.sizes[f] % mesh.axes_size(axes)
                             or used.intersection(axes) or depth and not may_shard(f, cand, rule, mesh)):
                    continue
                cand[f] = axes
                used.update(axes)
        return cand

    def _made_for_others(self, v: Value, op: Op) -> Optional[frozenset]:
        """The layouts of ``v`` that some op other than ``op`` makes anyway (what ``op``
        itself asked for in the last round is no gift to it)."""
        made = self.made.get(v)
        if not made:
            return None
        return frozenset(layout for layout, ops in made.items() if any(o is not op for o in ops)) or None

    def _situation(self, op: Op, cur: list) -> tuple:
        """Everything settling this op reads: its rule and what is decided of it, and
        the known dims, consumers' hints, pending partial and layouts other ops make anyway
        of every operand and result (what its open consumers' other operands are is added
        only where the choice reads it: ``_downstream_key``)."""
        dims, partial, hints, anyway, made = self.dims, self.partial, self.hints, self.made, self._made_for_others
        # the signature names the rule, the types and which operands are literals
        return (self.signature[op], tuple(cur), self.passthrough.get(op, "open"),
                tuple([(dims.get(v), hints.get(v), partial.get(v), made(v, op) if v in anyway else None)
                       for v in op.inputs]),
                tuple([(dims.get(v), hints.get(v), partial.get(v), made(v, op) if v in anyway else None)
                       for v in op.outputs]))

    def _best_candidate(self, op, rule, cur, sources, partial_operands):
        mesh = self.mesh
        cands: list[tuple[list, Optional[tuple], Optional[Source]]] = []
        pt_now = self.passthrough.get(op)
        reserved = pt_now[1] if pt_now else ()   # axes a decided passthrough partial already holds
        for i, s in enumerate(sources):
            cands.append((self._complete(rule, cur, [s] + sources[:i] + sources[i + 1:], reserved), None, s))
        if nesting(rule).places:
            # a split that cannot cross a merged dim where it is: the same split on the
            # merged dim, from its major end (the operand is then redistributed)
            for i, s in enumerate(sources):
                moved = regroup(rule, s.proposal, mesh)
                if moved is not None:
                    s2 = Source(s.kind, s.index, s.value, moved)
                    cands.append((self._complete(rule, cur, [s2] + sources[:i] + sources[i + 1:], reserved), None, s))
        if not sources:
            cands.append((list(cur), None, None))
        cands += self._combined_candidates(rule, cur, sources, reserved)
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
                            extra.append((keep_contiguous(rule, cc, mesh), (gi, axes), s))
            # partial -> sharded: a reduce_scatter (or MindSpore's all_reduce + slice),
            # onto a dim some neighbour wants split that way, or that no neighbour but the
            # partial itself has a say on, or when nothing reads the result but the
            # caller. Scattering onto a dim another neighbour holds whole (the residual
            # stream beside a row-parallel matmul's output) looks cheaper here, half an
            # all_reduce, but splits that stream away from everything downstream that
            # reads it whole (a layer norm's statistics then cost collectives of their own).
            wanted = {(f, a) for src in sources for f, a in src.proposal.items()}
            said = set()
            if any(self.users.get(v) for v in op.outputs):
                said = {f for src in sources if src.kind == "operand" and src.index not in partial_operands
                        for f in src.proposal}
                said.update(f for k, v in enumerate(op.outputs)
                            for f in project(rule.results[k], self.hints.get(v), rule, mesh))
            if pop == "sum" and rule.operands[n] and self.scatter_partials:
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
                            if not may_shard(f, c, rule, mesh):
                                continue
                            if f in said and (f, new) not in wanted:
                                continue
                            cc = list(c)
                            cc[f] = new
                            extra.append((cc, None, s))
        cands += extra
        seen, scored = set(), []
        for idx, (c, pt, s) in enumerate(cands):
            # a factor nobody proposes stays whole once the op settles: cost it that way
            c = [a if a is not None else () for a in c]
            key = (tuple(c), pt)
            if key in seen:
                continue
            seen.add(key)
            scored.append((self._score(op, rule, c, pt) + (idx,), c, pt, s))
        if not scored:
            return None
        key, c, pt, s = min(scored, key=lambda t: t[0])
        _, c, pt, s = self._improve(op, rule, cur, (key[:3], c, pt, s), reserved)
        return c, pt, s

    def _combined_candidates(self, rule, cur, sources, reserved) -> list:
        """Every neighbour's splits at once: a neighbour that holds a dim whole does not
        veto another's split of it (two operands split on different dims of an
        elementwise op each keep theirs, and each is only sliced, for free)."""
        splits = [Source(s.kind, s.index, s.value, {f: a for f, a in s.proposal.items() if a}) for s in sources]
        if sum(1 for s in splits if s.proposal) < 2:
            return []
        return [(self._complete(rule, cur, [s] + splits[:i] + splits[i + 1:], reserved), None, sources[i])
                for i, s in enumerate(splits) if s.proposal]

    def _improve(self, op, rule, cur, best, reserved):
        """Hill-climb from the best candidate: give a mesh axis the candidate leaves
        idle to one of the op's open factors (minor or major end) while that is
        cheaper. This finds what no neighbour proposed as such: an operand split on a
        dim the op needs whole moved onto another dim by all_to_all instead of
        gathered (concatenate, cumsum or a slice along a split dim); an operand
        pre-sliced over an idle axis so that an all_to_all or a reduction moves less.
        An axis that no neighbour splits over is taken only where it cuts this op's
        communication, not for compute alone: slicing it looks free here, but an op
        settled later may need the whole back (a layer norm's statistics sliced, then
        gathered for the next matmul)."""
        key, c, pt, s = best
        pt_axes = set(pt[1]) if pt else set(self.passthrough[op][1]) if self.passthrough.get(op) else set()
        near = set()
        for v in itertools.chain(op.inputs, op.outputs):
            for axes in itertools.chain(self.dims.get(v) or (), self.hints.get(v) or ()):
                near.update(axes or ())
        comm = key[0] - self._compute_time(op, rule, c)
        # results only the caller reads, in no layout in particular: nothing downstream
        # can need an idle axis back, so one may be taken for compute alone
        caller_only = not any(self.users.get(v) or any(self.hints.get(v) or ()) for v in op.outputs)
        if not self.scatter_partials and any(self.partial.get(v, ((), ""))[0] for v in op.inputs):
            return best   # a step would scatter the pending partial (this round completes it whole)
        if comm <= 0 and (self.scatter_partials or not caller_only):
            return best   # nothing moves: a step could only trade compute, which we leave to neighbours
        free = set(reserved) | pt_axes
        while True:
            # moves of several axes at once only where an operand moves already: an op that
            # takes every operand as it comes follows its producers (what its own partial
            # result costs is for its readers to weigh, or the caller's, as the seed
            # network's second matmul does in the MindSpore document)
            several = self._operands_cost(op, rule, c, pt if pt is not None else self.passthrough.get(op)) > 0
            step = self._best_step(op, rule, pt, key, comm,
                                   self._neighbour_candidates(rule, cur, c, free, near, groups=several), False,
                                   caller_only)
            if step is None and several:
                # no single step is cheaper: two at once (axes swapped between dims; a move
                # whose first half alone would split a merged dim's minor part under a major
                # one not fully split). Taken only where communication drops.
                step = self._best_step(op, rule, pt, key, comm, self._two_steps(rule, cur, c, free, near), True,
                                       caller_only)
            if step is None:
                return key, c, pt, s
            key, c, comm = step

    def _best_step(self, op, rule, pt, key, comm, candidates, must_cut_comm: bool, caller_only: bool):
        """The cheapest of ``candidates`` that beats ``key`` (``plan_core.improve``): (key,
        candidate, its communication), or None. Ties between steps: axes in mesh order
        within a dim, as layouts mostly come, so that a later step can still reach a
        plain all_to_all. A step that takes an idle axis (unless ``caller_only``: then it
        may, for compute) or ``must_cut_comm`` must cut communication."""
        def price(move, _bound):
            return self._score(op, rule, move[0], pt) + (self._inversions(move[0]),)

        def admit(move, k):
            cand, idle = move
            if not (idle and not caller_only or must_cut_comm):
                return True
            return k[0] - self._compute_time(op, rule, cand) < comm - 1e-15
        # (-1: a step must beat ``key`` itself, whatever its order of axes)
        found = best_move(candidates, price, key + (-1,), admit=admit)
        if found is None:
            return None
        (cand, _), k = found
        return k[:-1], cand, k[0] - self._compute_time(op, rule, cand)

    def _two_steps(self, rule, cur, c, reserved, near):
        """Candidates two steps from ``c`` (the first may break a merged dim's nesting,
        the second must mend it), each once."""
        seen = {tuple(c)}
        for mid, idle in self._neighbour_candidates(rule, cur, c, reserved, near, check=False, groups=True):
            for cand, idle2 in self._neighbour_candidates(rule, cur, mid, reserved, near, groups=True):
                key = tuple(cand)
                if key not in seen:
                    seen.add(key)
                    yield cand, idle or idle2

    def _inversions(self, cand) -> int:
        order = self.mesh.axis_index
        return sum(1 for axes in cand if axes for i, a in enumerate(axes) for b in axes[i + 1:]
                   if order(a) > order(b))

    def _neighbour_candidates(self, rule, cur, c, reserved, near, check: bool = True, groups: bool = True):
        """Candidates one step from ``c``: a mesh axis it leaves free inserted into an
        open factor (at any place in its order), or one of its axes moved to another
        place (another open factor, another place in the same one, or dropped), or all
        of an open factor's axes moved together into another (what one all_to_all of
        a dim split several ways does). Yields (candidate, whether it takes an axis no
        neighbour splits over). ``check``: only candidates whose merged dims nest;
        ``groups``: with the moves of a factor's axes together."""
        mesh = self.mesh
        open_f = [f for f in range(len(c)) if cur[f] is None and rule.shardable(f)]
        used = {a for axes in c if axes for a in axes}

        def placements(base, a):
            for f in open_f:
                axes = base[f] or ()
                for p in range(len(axes) + 1):
                    grown = axes[:p] + (a,) + axes[p:]
                    if rule.sizes[f] % mesh.axes_size(grown):
                        continue
                    cand = list(base)
                    cand[f] = grown
                    yield cand

        def valid(cand):
            return not check or all(may_shard(f, cand, rule, mesh) for f, x in enumerate(cand) if x)

        for a in mesh.axis_names:
            if a in reserved:
                continue
            if a not in used:
                for cand in placements(c, a):
                    if valid(cand):
                        yield cand, a not in near
                continue
            f = next(f for f, x in enumerate(c) if x and a in x)
            if cur[f] is not None:
                continue
            without = list(c)
            without[f] = tuple(x for x in c[f] if x != a)
            if valid(without):
                yield without, False
            for cand in placements(without, a):
                if cand != list(c) and valid(cand):
                    yield cand, False
        for f in open_f if groups else ():
            group = c[f]
            if not group or len(group) < 2 or reserved.intersection(group):
                continue
            for g in open_f:
                if g == f:
                    continue
                axes = c[g] or ()
                for p in range(len(axes) + 1):
                    grown = axes[:p] + tuple(group) + axes[p:]
                    if rule.sizes[g] % mesh.axes_size(grown):
                        continue
                    cand = list(c)
                    cand[f], cand[g] = (), grown
                    if valid(cand):
                        yield cand, False

    def _downstream(self, op: Op) -> tuple:
        """Per result: (consumer, its operand slot, sources from its other operands, what
        moving each of those costs relative to its bytes) for every consumer, when every
        consumer is still open and reads other operands of known layout; else ().
        Such a consumer will weigh this result against those operands. Its choice is
        priced here: the cheaper of moving this result and moving the others, an
        undecided other priced at the cheapest place upstream that can still honour
        a change (a broadcast of a small weight: the weight). So a hint that a small
        tensor sent back through the graph does not make a big activation follow it."""
        cached = self._down_cache
        if cached[0] is op:
            return cached[1]
        out = []
        for v in op.outputs:
            found = []
            hint = self.hints.get(v)
            if hint is None or all(h is None for h in hint):
                out.append(())   # no hint to weigh (``_cost`` reads this only against a hint)
                continue
            for u in self.users.get(v, ()):
                got = self._open_consumer(u, v)
                if not got:
                    found = []
                    break
                found.extend(got)
            out.append(tuple(found))
        out = tuple(out)
        self._down_cache = (op, out)
        return out

    def _open_consumer(self, u: Op, v: Value) -> list:
        cur_u = self.factors[u]
        if None not in cur_u or len(u.inputs) < 2:
            return []
        rule_u = self.rules[u]
        others = []
        for m, w in enumerate(u.inputs):
            if w is v or w.is_literal or w.type.rank == 0 or rule_u.operands[m] is None:
                continue
            dims = self.dims.get(w)
            if dims is None or None in dims or self.partial.get(w, ((), ""))[0]:
                return []
            prop = project(rule_u.operands[m], dims, rule_u, self.mesh)
            if prop:
                others.append((Source("operand", m, w, prop), self._honour_share(w)))
        if not others:
            return []
        return [(u, n, tuple(others)) for n, x in enumerate(u.inputs) if x is v and rule_u.operands[n] is not None]

    def _honour_share(self, w: Value, depth: int = 4) -> float:
        """The bytes of the cheapest place to change ``w``'s layout, as a share of its
        own: 1 once its producer has settled (or it is an input, or read elsewhere too);
        for an open producer, the least of ``w`` and its producer's operands (each in
        turn the same way)."""
        p = self.producer.get(w)
        if (p is None or None not in self.factors[p] or depth == 0 or not w.type.nbytes
                or len(self.users.get(w, ())) > 1):   # a value others read too keeps its layout for them
            return 1.0
        upstream = sum(u.type.nbytes * self._honour_share(u, depth - 1)
                       for u in p.inputs if not u.is_literal and u.type.rank)
        return min(1.0, upstream / w.type.nbytes)

    def _downstream_key(self, op: Op) -> tuple:
        """Everything ``_downstream_charge`` reads, for the situation memo."""
        anyway, made, hints, users = self.made, self._made_for_others, self.hints, self.users
        return tuple(tuple((self.signature[u], n, tuple(self.factors[u]),
                            made(v, u) if v in anyway else None,
                            tuple((hints.get(r), bool(users.get(r)), made(r, u) if r in anyway else None)
                                  for r in u.outputs),
                            tuple((s.index, self.dims[s.value], round(share, 6),
                                   made(s.value, u) if s.value in anyway else None) for s, share in others))
                           for u, n, others in found)
                     for v, found in zip(op.outputs, self._downstream(op)))

    def _downstream_charge(self, v: Value, mine: list, found: tuple) -> float:
        """What the open consumers of ``v`` will move if ``v`` comes out as ``mine``: the
        cheaper of following their other operands (``v`` moves) and following ``v`` (those
        operands move, each at its cheapest place), either way with what the consumer's
        own results then cost against their hints."""
        total = 0.0
        for u, n, others in found:
            rule_u, cur_u = self.rules[u], self.factors[u]
            sources = [s for s, _ in others]
            follow = self._complete(rule_u, cur_u, sources)
            need = self._tensor_axes(rule_u, follow)[0][n]
            have, want = self._layout_pair(mine, ((), "sum"), need, ((), "sum"))
            move_v = self._redistribution(u, v, have, want) + self._hinted_results(u, rule_u, follow)
            if move_v <= 0:
                continue
            if any(self.hints.get(r) is None or None in self.hints[r] for r in u.outputs if self.users.get(r)):
                total += move_v   # what the consumer's readers want is not all known: no way round
                continue
            mine_src = Source("operand", n, v, project(rule_u.operands[n], tuple(mine), rule_u, self.mesh))
            lead = self._complete(rule_u, cur_u, [mine_src] + sources)
            needs = self._tensor_axes(rule_u, lead)[0]
            move_others = self._hinted_results(u, rule_u, lead)
            for s, share in others:
                have, want = self._layout_pair(self.dims[s.value], ((), "sum"), needs[s.index], ((), "sum"))
                move_others += share * self._redistribution(u, s.value, have, want)
            total += min(move_v, move_others)
        return total

    def _hinted_results(self, u: Op, rule_u: FactorRule, factors: list) -> float:
        """What ``u``'s results cost against their consumers' hints under ``factors``."""
        total = 0.0
        result_axes = self._tensor_axes(rule_u, factors)[1]
        for v, mine in zip(u.outputs, result_axes):
            hint = self.hints.get(v)
            if hint is None or all(h is None for h in hint):
                continue
            have, want = self._layout_pair(mine, ((), "sum"), hint, ((), "sum"))
            total += self._redistribution(u, v, have, want)
        return total

    def _score(self, op, rule, c, pt) -> tuple:
        """How candidates compare: cost, then more sharding (less repeated work and
        memory), then axes spread over dims."""
        cost = self._cost(op, rule, c, pt if pt is not None else self.passthrough.get(op))
        return round(cost, 15), -sum(len(a) for a in c if a), max((len(a) for a in c if a), default=0)

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

    def _redistribution(self, op: Op, v: Value, have: Layout, want: Layout) -> float:
        if v in self.made and want in (self._made_for_others(v, op) or ()):
            return 0.0   # another op makes that copy anyway
        return self.cfg.prices.move(v, have, want, self.mesh, self.ctx.step_end)

    def _completion(self, v: Value, dims, partial) -> float:
        layout = Layout(tuple(a if a is not None else () for a in dims), partial[0], partial[1])
        return self.cfg.prices.completion(v, layout, self.mesh, self.ctx.step_end)[1]

    def _compute_time(self, op: Op, rule: FactorRule, factors) -> float:
        """The op's own work per device, as the search prices it (``cost.ComputeTimes``)."""
        return self.cfg.compute_times_of(self.g).time(op, rule.flops, factors)

    def _growth_charge(self, op: Op, rule: FactorRule, cand: list, group, axes) -> float:
        """Carrying a partial on defers its reduction; through an op that makes the
        tensor bigger (a broadcast) the later reduction costs more: charge the difference."""
        n = self.mesh.axes_size(axes)

        def reduce_time(v, fss):
            local = math.prod(s // self.mesh.axes_size(dim_axes(d, cand, rule, self.mesh) or ())
                              for s, d in zip(v.type.shape, fss))
            return self.cfg.cost.collective_time(wire_bytes("all_reduce", local * v.type.itemsize, n), "all_reduce",
                                                 axes, self.mesh)
        before = max(reduce_time(op.inputs[m], rule.operands[m]) for m in group)
        after = max(reduce_time(v, rule.results[k]) for k, v in enumerate(op.outputs))
        return max(0.0, after - before)

    def _operands_cost(self, op: Op, rule: FactorRule, cand: list, pt) -> float:
        """Time to move every operand into what ``cand`` needs."""
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
            total += self._redistribution(op, v, h, w)
        return total

    def _cost(self, op: Op, rule: FactorRule, cand: list, pt) -> float:
        mesh = self.mesh
        total = self._operands_cost(op, rule, cand, pt)
        pt_group = rule.linear[pt[0]][0] if pt else ()
        pt_axes = mesh.sort_axes(pt[1]) if pt else ()
        pt_op = rule.linear[pt[0]][1] if pt else "sum"
        red_axes = [a for f in rule.reduction if cand[f] for a in cand[f]]
        res_partial = (mesh.sort_axes(red_axes + list(pt_axes)),
                       pt_op if pt else (rule.reduce_op or "sum"))
        downstream = None
        for n, v in enumerate(op.outputs):
            hint = self.hints.get(v)
            if hint is None or all(h is None for h in hint):
                if res_partial[0] and not self.users.get(v):
                    # only the caller reads it, in no layout in particular, yet a partial
                    # sum is completed before it is returned: charge the cheapest completion
                    # (for a value ops read, they settle later and say what they need)
                    total += self._completion(v, [dim_axes(d, cand, rule, mesh) for d in rule.results[n]],
                                              res_partial)
                continue
            mine = [dim_axes(d, cand, rule, mesh) for d in rule.results[n]]
            h, w = self._layout_pair(mine, res_partial, hint, ((), "sum"))
            charge = self._redistribution(op, v, h, w)
            if charge > 0 and not res_partial[0]:
                # a hint is what consumers wished before anything settled; where every
                # consumer is open beside operands of known layout, honouring it may be
                # cheaper at those operands (a small weight the hint came from)
                downstream = downstream or self._downstream(op)
                self.read_downstream = True
                if downstream[n]:
                    charge = min(charge, self._downstream_charge(v, mine, downstream[n]))
            total += charge
        if pt:
            total += self._growth_charge(op, rule, cand, pt_group, pt_axes)
        total += self._compute_time(op, rule, cand)
        return total
