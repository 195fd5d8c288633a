"""Writing a propagation's plan into the graph, and what the plan costs.

Every op gets its strategy and origin, every value the layout its producer makes;
on the way, which operands must be redistributed (and for which ops) is read off,
so that a second round can learn which values some other op reduces or gathers
anyway. The plan is priced by the one evaluator (``plan_core.evaluate``), so that
rounds can be compared.
"""
from __future__ import annotations

from ..ir.graph import Op
from ..ir.layout import Layout

from .plan_core.evaluate import evaluate_written
from .plan_core.write import DEFAULT, propagated, write_plan


class PlanMixin:
    def needs(self):
        """{(value, layout an op needs it in): the ops that need it} for every operand
        that must be redistributed (found while the plan was written)."""
        return self._needs

    def carried_elsewhere(self, made: dict) -> bool:
        """Does some value that gets reduced or gathered reach another op in a
        different layout? Only then can a second round save a redistribution, by
        letting that op take the copy made anyway."""
        for v in made:
            wanted = {u.strategy.operand_layout(n, v.type.rank, self.mesh)
                      for u in self.users.get(v, []) for n, x in enumerate(u.inputs) if x is v}
            if len(wanted) > 1:
                return True
        return False

    def made_anyway(self, needs) -> dict:
        """Values some op reduces in place (a partial sum completed, dims kept) or
        gathers (dims made whole, nothing else changed): {value: {layout: the ops
        that need it}}."""
        out: dict = {}
        for (v, need), ops in needs.items():
            have = v.layout
            if have.partial and need == have.without_partial() or not have.partial and not need.partial and all(
                    h[:len(w)] == w for h, w in zip(have.dims, need.dims)):
                out.setdefault(v, {}).setdefault(need, set()).update(ops)
        return out

    def scattered_partials(self, needs) -> bool:
        """Does the plan (just written) scatter a pending partial onto a dim?"""
        for v, need in needs:
            have = v.layout
            if have.partial and not need.partial and set(have.partial) & set(need.sharded_axes()):
                return True
        return False

    def moves(self, needs) -> int:
        """How many of the plan's (just written) redistributions move data: all but
        local slices."""
        return sum(1 for v, need in needs
                   if v.layout.partial or any(n[:len(h)] != h for h, n in zip(v.layout.dims, need.dims)))

    def plan_cost(self) -> float:
        """Modeled time of the plan just written (``plan_core.evaluate``; a copy that
        several ops need is made once, as insert-reshards makes it)."""
        e = evaluate_written(self.ctx, self.cfg.prices, self.cfg.compute_times_of(self.g), detail=False)
        return e["compute"] + e["communication"]

    def _placement(self, op: Op, factors: tuple, passthrough) -> tuple:
        """What a strategy means for ops of this signature: (the strategy, shared by
        all ops with an equal one; the layout each operand needs, None for a literal;
        each result's layout)."""
        mesh, rule = self.mesh, self.rules[op]
        st = self.ctx.book.strategy(rule, factors, passthrough)
        problems = st.problems(mesh)
        if problems:
            raise AssertionError(f"propagation produced an invalid strategy for {op.describe()}: {problems}")
        return (st,
                tuple(None if v.literal is not None else st.operand_layout(n, v.type.rank, mesh)
                      for n, v in enumerate(op.inputs)),
                tuple(st.result_layout(n, mesh) for n in range(len(op.outputs))))

    def write_plan(self) -> None:
        """Every op's strategy and origin, every value's layout, into the graph
        (``plan_core.write``); on the way, what must be redistributed."""
        mesh = self.mesh
        inputs = {}
        for i, v in enumerate(self.g.inputs):
            # an input arrives as its first deciding consumer takes it (wishes are only wishes)
            dims = self._dims(v) if i in self.g.pinned_inputs else self.taken.get(v, self._dims(v))
            layout = Layout(tuple(a if a is not None else () for a in dims))
            inputs[i] = layout if layout.fits(v.type.shape, mesh) else Layout.replicated(v.type.rank)
        self._needs = {}
        write_plan(self.g, inputs, self._placed())
        needs = self._needs
        for v in self.g.outputs:
            if v.layout is not None and v.layout.partial:
                needs.setdefault((v, v.layout.without_partial()), []).append(None)   # the caller

    def _placed(self):
        """Per op in program order, what ``write_plan`` writes; what must be redistributed
        is read off on the way (every operand's layout is written already)."""
        placements, needs, regions = self.cfg.placements, self._needs, self.g.regions
        signature, factors, passthrough, origin = self.signature, self.factors, self.passthrough, self.origin
        for op in self.g.ops:
            key = (signature[op], tuple(factors[op]), passthrough.get(op))
            placed = placements.get(key)
            if placed is None:
                placed = placements[key] = self._placement(op, key[1], key[2])
            st, operand_layouts, result_layouts = placed
            for v, need in zip(op.inputs, operand_layouts):
                if need is not None and need is not v.layout and need != v.layout:
                    needs.setdefault((v, need), []).append(op)
            why = origin.get(op) or DEFAULT
            # the op named there, so a report can follow the chain back to the user's mark
            via = why[2] if type(why) is tuple and isinstance(why[2], Op) else None
            yield op, st, propagated(why, regions), via, result_layouts
