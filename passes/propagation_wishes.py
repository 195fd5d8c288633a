"""The wish phase of propagation: what neighbours agree on travels, nothing is decided.

From the pinned layouts, each op passes what its other neighbours agree about its
open factors to a neighbour's unknown dims (and, from consumers, to its hints),
forwards and backwards, until nothing changes. Where two wishes meet on a dim, a
wish to split it beats a whole that only wishes carried there (*soft*): being
closer to the meeting point must not decide it. Donated state nobody pinned is
told, once the wishes settle, the layout its input arrives in, and that is carried
back as hints through the update.
"""
from __future__ import annotations

import functools
from typing import Optional

from ..ir.graph import Op, Value

from .propagation_choice import Source
from .rules.base import FactorRule
from .sharding import project

_OPEN = object()   # not worked out yet (a memo miss)


@functools.lru_cache(maxsize=4096)   # bounded: a long-lived process meets ever new layouts
def _whole_dims(axes: tuple) -> frozenset:
    """The dims that per-dim ``axes`` make whole."""
    return frozenset(d for d, a in enumerate(axes) if a == ())


def _open_soft(old: tuple, axes: tuple, soft: frozenset) -> tuple:
    """``old`` with the soft dims that ``axes`` splits open again."""
    return tuple(None if d in soft and a else o for d, (o, a) in enumerate(zip(old, axes)))


def fill_open(old: tuple, axes: tuple) -> tuple:
    """``old`` with its unknown (None) dims taken from ``axes``, but a dim whose axes
    another dim holds already is taken whole: wishes from different ops may disagree (a
    weight's rows split on an axis by one reader, its columns on the same axis by
    another), and a mesh axis splits one dim of a value at most. (Left unknown, the dim
    would be wished again and again: propagation would not settle.)"""
    used = {a for o in old if o for a in o}
    out = []
    for o, a in zip(old, axes):
        if o is None and a:
            if used.intersection(a):
                a = ()
            else:
                used.update(a)
        out.append(a if o is None else o)
    return tuple(out)


class WishMixin:
    """Phase one of ``Propagation`` (see the module docstring); needs its state."""

    def _visit(self, op: Op) -> None:
        """Pass on what this op's neighbours agree about its open factors (nothing
        is decided here; contested factors wait for settling)."""
        cur = self.factors[op]
        if None not in cur and op in self.passthrough:
            return
        rule = self.rules[op]
        memo = self.cfg.wish_memo
        if memo is None:
            wishes = self._wishes(op, rule, cur)
        else:
            # what the neighbours agree on depends only on what they say: work it out
            # once per situation (repeated layers meet the same ones again and again)
            dims, hints, partial = self.dims, self.hints, self.partial
            soft = self.soft if self.wishing else {}
            key = (id(rule), tuple(cur), op in self.passthrough,
                   tuple([(v.literal is not None, dims.get(v), hints.get(v), partial.get(v), soft.get(v))
                          for v in op.inputs]),
                   tuple([(dims.get(v), soft.get(v)) for v in op.outputs]))
            wishes = memo.get(key)
            if wishes is None:
                wishes = memo[key] = self._wishes(op, rule, cur)
        for to_operand, n, axes in wishes:
            self._fill((op.inputs if to_operand else op.outputs)[n], axes, op, to_operand)

    def _wishes(self, op: Op, rule: FactorRule, cur: list) -> tuple:
        """What this op passes on, as (to an operand?, index, per-dim axes): the
        neighbours' agreement on its open factors; nothing if they disagree."""
        sources, useful, partial_operands = self._neighbours(op, rule, cur)
        if sources is not None and self.wishing and self.soft and self._contested(cur, useful):
            # a wish to split beats one for whole that only wishes carried here
            sources, useful, partial_operands = self._neighbours(op, rule, cur, hush_soft=True)
        if sources is None or self._contested(cur, useful):
            return ()
        return tuple(self._agreed(op, rule, cur, useful))

    def _agreed(self, op: Op, rule: FactorRule, cur: list, sources: list[Source]):
        """For the unknown dims of this op's operands and results: what its
        neighbours agree on. What goes to one neighbour is made from the others
        only, so a value never hears its own wish echoed back."""
        for side, tensors, fss in (("operand", op.inputs, rule.operands), ("result", op.outputs, rule.results)):
            for n, (v, fs) in enumerate(zip(tensors, fss)):
                if fs is None or v.type.rank == 0 or v.is_literal or self._settled(v, side == "operand"):
                    continue
                others = [s for s in sources if not (s.kind == side and s.index == n)]
                if others:
                    operand_axes, result_axes = self._tensor_axes(rule, self._complete(rule, cur, others))
                    axes = (operand_axes if side == "operand" else result_axes)[n]
                    if self._settled(v, side == "operand", soft=False) and not any(axes[d] for d in self.soft[v]):
                        continue   # known but for soft wholes, and this wish splits none of them
                    yield (side == "operand", n, axes)

    def _settled(self, v: Value, from_consumer: bool, soft: bool = True) -> bool:
        """Nothing left to fill: every dim known (and, for a consumer's wish, hinted);
        while wishing, a soft whole may still be split (unless ``soft`` is False)."""
        dims = self.dims.get(v)
        if dims is None or None in dims or soft and self.wishing and v in self.soft:
            return False
        if from_consumer:
            hints = self.hints.get(v)
            return hints is not None and None not in hints
        return True

    def _said(self, v: Value) -> tuple:
        """The dims of ``v`` less those only a wish made whole."""
        dims = self.dims[v]
        soft = self.soft.get(v)
        return tuple(None if d in soft else a for d, a in enumerate(dims)) if soft else dims

    def _fill(self, v: Value, axes: tuple, op: Op, from_consumer: bool) -> None:
        """Write per-dim ``axes`` into the dims of ``v`` nobody has said yet (and, for
        a consumer's wish, into its hints)."""
        soft = self.soft.get(v) if self.wishing else None
        opens = soft is not None and any(axes[d] for d in soft)   # splits a soft whole
        if from_consumer:
            hints = self.hints.get(v)
            if opens and hints is not None:
                hints = _open_soft(hints, axes, soft)
            if hints is None:
                self.hints[v] = axes
            elif None in hints:
                self.hints[v] = fill_open(hints, axes)
        dims = old = self.dims.get(v)
        if opens:
            dims = _open_soft(dims, axes, soft)
        if self.wishing:
            self._soften(v, old, axes, soft)
        if dims is None:
            if all(a is None for a in axes):
                self.dims[v] = axes
                return
            new = axes
        elif None not in dims:
            return
        else:
            new = fill_open(dims, axes)
            if new == old:
                return
        self.dims[v] = new
        if dims is not old:   # a split replaced a soft whole: this op speaks for v now
            self.setter[v] = ("consumer" if from_consumer else "producer", op)
        else:
            self.setter.setdefault(v, ("consumer" if from_consumer else "producer", op))
        self._enqueue(self.producer.get(v), op)
        for u in self.users.get(v, ()):
            self._enqueue(u, op)

    def _soften(self, v: Value, old: Optional[tuple], axes: tuple, soft: Optional[frozenset]) -> None:
        """Note which dims of ``v`` this wish makes whole (those nobody had said yet),
        and which soft ones it splits."""
        whole = _whole_dims(axes)
        if old is None:
            now = whole
        elif soft is None:
            now = frozenset(d for d in whole if old[d] is None)
        else:
            now = frozenset([d for d in whole if old[d] is None or d in soft]
                            + [d for d in soft if not axes[d]])
        if now != (soft or frozenset()):
            if now:
                self.soft[v] = now
            else:
                self.soft.pop(v, None)

    def _tie_free_state(self) -> bool:
        """State outputs that replace an input nobody pinned come back in the layout
        that input arrives in, which is known only now, as wishes: say so at the
        output, so the update (an optimizer's) plans for it, instead of scattering
        a gradient that must then be gathered back at the very end."""
        g, told = self.g, []
        for i, j in g.tied_outputs.items():
            v, out = g.inputs[j], g.outputs[i]
            wished = self.dims.get(v)
            if j in g.pinned_inputs or i in g.pinned_outputs or out.is_literal or wished is None:
                continue
            old_dims, old_hints = self.dims.get(out), self.hints.get(out)
            dims = wished if old_dims is None else fill_open(old_dims, wished)
            # a dim nobody has said anything about arrives whole (see write_plan)
            arrives = tuple(() if a is None else a for a in wished)
            hints = arrives if old_hints is None else fill_open(old_hints, arrives)
            if (dims, hints) != (old_dims, old_hints):
                self.dims[out], self.hints[out] = dims, hints
                name = g.input_names[j] if j < len(g.input_names) else f"#{j}"
                self.setter[out] = ("consumer", f"output {i}, which comes back as input {name} arrives")
                self._enqueue(self.producer.get(out))
                told.append(out)
        self._hints_back(told)
        return bool(told)

    def _hints_back(self, values: list) -> None:
        """Carry what the consumers of ``values`` ask for back to their producers'
        operands, and on, where nobody has asked yet (hints only: wishes stop at values
        whose dims are known, and a gradient's dims are known long before the
        optimizer's). Each value is passed on once, and again only when its hints
        grow (they only fill in), so the walk is linear in the graph."""
        stack, seen = list(values), set(values)
        memo = self.cfg.hints_memo   # (rule, result, its hints) -> what that asks of the operands
        while stack:
            v = stack.pop()
            op = self.producer.get(v)
            if op is None or None not in self.factors[op]:
                continue   # a graph input, or an op decided already (it said what it needs)
            rule = self.rules[op]
            key = (id(rule), op.outputs.index(v), self.hints[v])
            operand_axes = memo.get(key, _OPEN)
            if operand_axes is _OPEN:
                said = project(rule.results[key[1]], key[2], rule, self.mesh)
                operand_axes = memo[key] = self._tensor_axes(
                    rule, [said.get(f) for f in range(rule.num_factors)])[0] if said else None
            if operand_axes is None:
                continue
            for u, axes in zip(op.inputs, operand_axes):
                if axes is None or u.is_literal or u.type.rank == 0 or all(a is None for a in axes):
                    continue
                old = self.hints.get(u)
                new = axes if old is None else fill_open(old, axes)
                # on even where nothing changed here: an earlier wish may have stopped
                # at this value, leaving its producers' operands unhinted
                if new != old or u not in seen:
                    self.hints[u] = new
                    seen.add(u)
                    stack.append(u)
