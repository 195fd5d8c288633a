"""After the solve: let followers and arguments leave the layout the coarse problem
tied them to, where that is cheaper under the same cost model.

The problem makes an elementwise op follow its operand and shares one choice
between repeated layers; both are restrictions. Here every op that followed (and
every argument) is offered, one at a time with everything else kept, the layouts
its neighbours propose: each operand's layout, what each consumer needs of it,
and the whole tensor. A move is kept only when it lowers the plan's modeled time
(its own compute plus every redistribution into and out of it), so the refined
plan is never worse than the solver's. Typical win: an activation that two
consumers need whole is gathered once before its elementwise op, instead of
after it for each consumer.
"""
from __future__ import annotations

from ...ir.layout import Layout

from ..sharding import OpStrategy, project


def refine(problem, ops: dict, inputs: dict, sweeps: int = 3) -> tuple[dict, dict]:
    g, mesh = problem.graph, problem.mesh
    ops, inputs = dict(ops), dict(inputs)
    users: dict = {}
    for op in g.ops:
        for m, v in enumerate(op.inputs):
            users.setdefault(v, []).append((op, m))
    out_target = {}   # output value -> [(index, how)]
    for i, v in enumerate(g.outputs):
        out_target.setdefault(v, []).append(i)
    followers = [op for n in problem.nodes for op in (n.members[1:] if not n.is_input else n.members)]
    producer_of = {v: op for op in g.ops for v in op.outputs}

    def layout_of(v):
        if v in producer_of:
            op = producer_of[v]
            return ops[op].result_layout(op.outputs.index(v), mesh)
        return inputs.get(g.inputs.index(v)) if v in input_index else None
    input_index = {v: i for i, v in enumerate(g.inputs)}

    def out_cost(v, have):
        total = 0.0
        for u, m in users.get(v, ()):
            total += problem.redistribution(v, have, ops[u].operand_layout(m, v.type.rank, mesh))
        for i in out_target.get(v, ()):
            target = g.pinned_outputs.get(i)
            if target is None and i in g.tied_outputs:
                target = inputs[g.tied_outputs[i]]
            if target is None:
                from ..insert_reshards import cheapest_completion
                total += cheapest_completion(v.type.shape, v.type.itemsize, have, mesh, problem.allow_rs,
                                             problem.cost)[1]
            else:
                total += problem.redistribution(v, have, target)
        return total

    def op_cost(op, st):
        total = problem.op_compute(op, st)
        for m, v in enumerate(op.inputs):
            have = layout_of(v) if v.literal is None else None
            if have is not None:
                total += problem.redistribution(v, have, st.operand_layout(m, v.type.rank, mesh))
        for k, v in enumerate(op.outputs):
            total += out_cost(v, st.result_layout(k, mesh))
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
        for factors in cands:
            st = OpStrategy(rule, factors)
            if st not in seen and not st.problems(mesh):
                seen.add(st)
                yield problem._strategy(rule, factors, None)

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

    for _ in range(sweeps):
        improved = False
        for op in followers:
            best, best_cost = ops[op], op_cost(op, ops[op])
            for st in proposals(op):
                ops[op] = st
                c = op_cost(op, st)
                if c < best_cost - 1e-15:
                    best, best_cost = st, c
                    improved = True
            ops[op] = best
        for i, v in enumerate(g.inputs):
            if i in g.pinned_inputs or not users.get(v):
                continue
            current = inputs[i]
            best, best_cost = current, input_cost(i, current)
            for u, m in users[v]:
                need = ops[u].operand_layout(m, v.type.rank, mesh)
                need = Layout(need.dims)
                if need == best or not need.fits(v.type.shape, mesh):
                    continue
                inputs[i] = need
                c = input_cost(i, need)
                inputs[i] = current
                if c < best_cost - 1e-15:
                    best, best_cost = need, c
                    improved = True
            inputs[i] = best
        if not improved:
            break
    return ops, inputs
