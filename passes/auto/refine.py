"""After the solve: let ops and arguments leave the layout the coarse problem tied
them to, where that is cheaper under the same cost model.

The problem makes an elementwise op follow its operand and shares one choice
between repeated layers; both are restrictions. Here every op but the matmuls (the
followers, and the elementwise ops that decide for themselves) and every argument is
offered, one at a time with everything else kept, the layouts its neighbours propose
(each operand's layout, what each consumer needs of it, the whole tensor) and free
slices of its own (an unused mesh axis added to a factor; all of them at once where an
operand arrives partial). An op moves together with the few ops whose layout follows
from its own (what follows it, what is made for it, the followers that feed it alone;
``MOVE_SIZE``), priced as one group. A move is kept only when it lowers the plan's
modeled time (the group's compute plus every move of the values it reads or makes), so
the refined plan is never worse than the solver's; an argument's tie goes to the layout
that holds fewer bytes. Typical wins: an activation that two consumers need whole is
gathered once before its elementwise op, instead of after it for each consumer; a
loss's square and sum run on a slice of a difference that is replicated; a weight's
update runs split over every axis, its gradient reduce-scattered where it is made.
"""
from __future__ import annotations

import itertools

from ...ir.graph import CONSTRAINT
from ...ir.layout import Layout

from ..rules import FIXED
from ..sharding import OpStrategy, project
from ..insert_reshards import gathered_per_use
from ..plan_core.improve import best_move
from .memory import local_bytes
from .problem import DECIDERS

MOVE_SIZE = 4   # ops a refinement move may take along (the first and what its layout decides)


def free_slices(rule, current: tuple, mesh_axes: tuple, all_at_once: bool) -> list:
    """Factors ``current`` with mesh axes it leaves unused added: one unused axis on one
    shardable factor that is not reduced; with ``all_at_once`` also all of them on one
    (in either order, since the order is how the split nests)."""
    used = {a for axes in current for a in axes}
    spare = [a for a in mesh_axes if a not in used]
    targets = [f for f in range(rule.num_factors) if rule.shardable(f) and f not in rule.reduction]
    added = [(a,) for a in spare] + (list(itertools.permutations(spare)) if all_at_once and len(spare) > 1 else [])
    return [current[:f] + (current[f] + axes,) + current[f + 1:] for axes in added for f in targets]


def refine(problem, ops: dict, inputs: dict, sweeps: int = 3) -> tuple[dict, dict, float]:
    """(op -> strategy, input index -> layout, seconds the moves saved by their own
    pricing: the plan's modeled time less that is the refined plan's)."""
    g, mesh = problem.graph, problem.mesh
    ops, inputs = dict(ops), dict(inputs)
    users: dict = {}
    for op in g.ops:
        for m, v in enumerate(op.inputs):
            users.setdefault(v, []).append((op, m))
    out_target = {}   # output value -> [(index, how)]
    for i, v in enumerate(g.outputs):
        out_target.setdefault(v, []).append(i)
    # every op but the matmuls and what the user or a loop fixes: followers, and the
    # elementwise ops that decide for themselves (a weight's update, a residual sum)
    movable = [op for n in problem.nodes for op in n.members
               if not (op is n.root and (op.kind in DECIDERS or op.subgraphs or op.kind in FIXED
                                         or op.region is not None or op.kind == CONSTRAINT))]
    producer_of = {v: op for op in g.ops for v in op.outputs}

    def layout_of(v):
        if v in producer_of:
            op = producer_of[v]
            return ops[op].result_layout(op.outputs.index(v), mesh)
        return inputs.get(g.inputs.index(v)) if v in input_index else None
    input_index = {v: i for i, v in enumerate(g.inputs)}

    decision, stored = problem.decisions, problem.ctx.stored

    def out_cost(v, have):
        """Every move of ``v`` from ``have`` to what its readers need and to its outputs'
        layouts, as the objective prices them: a layout once per reading decision (a
        stored value gathered bigger once per read, as insert-reshards writes it)."""
        total, copies = 0.0, set()
        for u, m in users.get(v, ()):
            need = ops[u].operand_layout(m, v.type.rank, mesh)
            if need == have:
                continue
            copy = (need, decision[u])
            if copy in copies and not gathered_per_use(v, have, need, stored, mesh):
                continue
            copies.add(copy)
            total += problem.redistribution(v, have, need)
        for i in out_target.get(v, ()):   # priced as the objective prices it
            total += problem.prices.output(g, i, have, inputs.__getitem__, mesh, problem.step_end)[1]
        return total

    # a move takes along the ops whose layout is derived from the moved one: what is made
    # for it (a broadcast of a scalar into a select: the layout it needs) and the next
    # ops that follow it (a loss's square and sum on the free slice its difference gets)
    made_for: dict = {}
    followed_by: dict = {}
    for n in problem.nodes:
        for op, m in zip(n.members, n.main):
            if type(m) is tuple:
                made_for.setdefault(n.members[m[1]], []).append((op, m[2]))
            elif m >= 0 and op.inputs[m] in producer_of:
                followed_by.setdefault(producer_of[op.inputs[m]], []).append((op, m))

    # and the followers that feed it alone (a weight gradient's transpose and its scaling
    # by the learning rate, on their way to the update): where the update moves to a
    # split, they make its operand in that split, so the gradient is reduce-scattered
    # where it is made instead of all-reduced
    fed_by: dict = {}
    follower_set = {op for n in problem.nodes for op in n.members[1:]}
    for op in g.ops:
        for m, v in enumerate(op.inputs):
            p = producer_of.get(v)
            if p in follower_set and len(p.outputs) == 1 and [u for u, _ in users.get(v, ())] == [op]:
                fed_by.setdefault(op, []).append((p, m))

    def moved_with(op, st) -> dict:
        """{op: st} and the strategies of what moves with it, breadth first, at most
        MOVE_SIZE ops (beyond, an op keeps its strategy and its operand is moved to it)."""
        group, todo = {op: st}, [op]
        while todo:
            u = todo.pop(0)
            for b, m in [*made_for.get(u, ()), *fed_by.get(u, ())]:
                if b not in group and len(group) < MOVE_SIZE:
                    group[b] = problem._follow_consumer(b, group[u].operand_layout(m, u.inputs[m].type.rank, mesh))
                    todo.append(b)
            for f, m in followed_by.get(u, ()):
                if f not in group and len(group) < MOVE_SIZE:
                    k = u.outputs.index(f.inputs[m])
                    group[f] = problem._follow(f, m, group[u].result_layout(k, mesh))
                    todo.append(f)
        return group

    def group_cost(group, bound=float("inf")) -> float:
        """Compute of the ops of ``group`` under ``ops``, and every move of the values they
        read or make (``out_cost``: a move the group shares with other readers priced as the
        objective prices it). Stops once past ``bound`` (a move that costs more is not taken
        anyway)."""
        total = sum(problem.op_compute(op, ops[op]) for op in group)
        touched = dict.fromkeys(v for op in group for v in (*op.inputs, *op.outputs) if v.literal is None)
        for v in touched:
            if total >= bound:
                return total
            have = layout_of(v)
            if have is not None:
                total += out_cost(v, have)
        return total

    def proposals(op):
        rule = problem.rules(op)
        seen = {ops[op]}
        dims_list = []
        for m, v in enumerate(op.inputs):
            have = layout_of(v) if v.literal is None else None
            if have is not None and rule.operands[m] is not None:
                dims_list.append((rule.operands[m], have.dims))
        for k, v in enumerate(op.outputs):
            for u, m in users.get(v, ()):
                dims_list.append((rule.results[k], ops[u].operand_layout(m, v.type.rank, mesh).dims))
        cands = [((),) * rule.num_factors]
        for fs, dims in dims_list:
            prop = project(fs, dims, rule, mesh)
            cands.append(tuple(prop.get(f, ()) if rule.shardable(f) else () for f in range(rule.num_factors)))
        # and the op on a free slice of what it has: mesh axes it leaves unused added to its
        # factors (a loss's square and sum split over the axis its difference is replicated
        # on; a slice of a value is free, its reader pays what follows)
        # (every unused axis at once where an operand arrives partial: the sum is then
        # reduce-scattered over them rather than all-reduced, a weight's update split)
        partial_in = any(v.literal is None and (layout_of(v) or Layout(())).partial for v in op.inputs)
        cands += free_slices(rule, ops[op].factors, mesh.axis_names, partial_in)
        for factors in cands:
            st = valid_strategy(rule, factors)
            if st is not None and st not in seen:
                seen.add(st)
                yield st

    valid: dict = {}   # memo: (rule, factors) -> its strategy, or None where the mesh rejects it

    def valid_strategy(rule, factors):
        key = (id(rule), factors)
        if key not in valid:
            valid[key] = None if OpStrategy(rule, factors).problems(mesh) else problem.ctx.book.strategy(rule, factors)
        return valid[key]

    def input_cost(i, layout):
        v = g.inputs[i]
        total = out_cost(v, layout)
        for j, tied in g.tied_outputs.items():
            if tied == i:
                w = g.outputs[j]
                have = layout_of(w) if w.literal is None else None
                if have is not None:
                    total += problem.redistribution(w, have, layout)   # returned state comes back in it
        return total

    def price(op):
        def priced(st, bound):   # the plan with op (and what moves with it) at st
            group = moved_with(op, st)
            ops.update(group)
            return group_cost(group, bound)
        return priced

    # every movable op in the first sweep; later sweeps revisit only the neighbours of what moved
    dirty = set(movable)
    gain = 0.0
    for _ in range(sweeps):
        moved: set = set()   # ops that moved this sweep, and the readers of arguments that did
        for op in movable:
            if op not in dirty:
                continue
            now = {u: ops[u] for u in moved_with(op, ops[op])}   # the same ops for every st
            now_cost = group_cost(now)
            found = best_move(proposals(op), price(op), now_cost, better=_cheaper)
            if found is None:
                ops.update(now)
                continue
            group = moved_with(op, found[0])
            ops.update(group)
            moved.update(group)
            gain += now_cost - found[1]
        for i, v in enumerate(g.inputs):
            if i in g.pinned_inputs or not users.get(v):
                continue
            current = inputs[i]
            best, best_cost = current, input_cost(i, current)
            now_cost = best_cost
            for u, m in users[v]:
                need = ops[u].operand_layout(m, v.type.rank, mesh)
                need = Layout(need.dims)
                if need == best or not need.fits(v.type.shape, mesh):
                    continue
                inputs[i] = need
                c = input_cost(i, need)
                inputs[i] = current
                # on a tie, the layout that holds fewer bytes (an argument a reader takes a
                # free slice of arrives as that slice; the solver's own tie-break is below
                # HiGHS's tolerances)
                if c < best_cost - 1e-15 or (c <= best_cost + 1e-15
                                             and local_bytes(v, need, mesh) < local_bytes(v, best, mesh)):
                    best, best_cost = need, min(c, best_cost)
                    moved.update(u for u, _ in users[v])
            inputs[i] = best
            gain += now_cost - best_cost
        if not moved:
            break
        dirty = set(moved)
        for op in moved:   # what reads from or feeds an op that moved may now move too
            dirty.update(producer_of[v] for v in op.inputs if v in producer_of)
            dirty.update(u for v in op.outputs for u, _ in users.get(v, ()))
    return ops, inputs, gain


def _cheaper(a: float, b: float) -> bool:
    return a < b - 1e-15
