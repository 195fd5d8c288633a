"""mode="auto": the strategy search (passes/auto).

Correctness is differential (the searched plan's outputs and gradients equal one
device's); the plans are checked for what a performance engineer would write
(data parallel for a small model on a big batch, weights split when they do not
fit), and for quality against the exact, un-coarsened ILP on small graphs.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardprop as sp
from shardprop.compiler.state import state_ties
from shardprop.compiler.trace import import_jaxpr, input_names
from shardprop.ir.mesh import Mesh
from shardprop.passes.auto import SearchStrategies, milp, parse_memory_limit
from shardprop.passes.auto.problem import Problem
from shardprop.passes.bind_strategies import BindUserStrategies
from shardprop.passes.cost import DEFAULT_COST


def mlp_loss(params, x, y):
    h = x
    for w in params[:-1]:
        h = jax.nn.relu(h @ w)
    return jnp.mean((h @ params[-1] - y) ** 2)


def sgd_step(params, x, y):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
    return [p - 0.1 * g for p, g in zip(params, grads)], loss


def problem_data(batch, width, layers, seed=0):
    rng = np.random.default_rng(seed)
    params = [(rng.standard_normal((width, width)) * 0.05).astype(np.float32) for _ in range(layers)]
    x = rng.standard_normal((batch, width)).astype(np.float32)
    y = rng.standard_normal((batch, width)).astype(np.float32)
    return params, x, y


def assert_close(a, b, tol=1e-5):
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol)


def input_layout(plan, i):
    return plan.graph.inputs[i].layout


# -- differential correctness -----------------------------------------------------

@pytest.mark.parametrize("mesh", [8, ((2, 4), ("dp", "mp"))])
@pytest.mark.parametrize("batch,width", [(2048, 256), (32, 512)])
def test_auto_plan_equals_one_device(mesh, batch, width):
    params, x, y = problem_data(batch, width, 2)
    pstep = sp.parallelize(sgd_step, mesh=mesh, mode="auto")
    assert_close(pstep(params, x, y), jax.jit(sgd_step)(params, x, y))
    plan = pstep.plan(params, x, y)
    assert all(o.origin.startswith("auto") for o in plan.ops if o.primitive == "dot_general")


def test_auto_gradients_equal_one_device():
    params, x, y = problem_data(1024, 256, 3)
    grad = jax.grad(mlp_loss)
    pgrad = sp.parallelize(grad, mesh=((2, 4), ("dp", "mp")), mode="auto")
    assert_close(pgrad(params, x, y), jax.jit(grad)(params, x, y))


@pytest.mark.slow
def test_gpt_loss_and_gradients_without_marks_equal_one_device(monkeypatch):
    """Attention, layer norms and the tied LM head, forward and backward, with no mark:
    the searched plan splits some of it and computes what one device computes. (The
    gradients, not an Adam step: Adam's first update divides a gradient by its own
    size, so a float32 rounding of a near-zero gradient moves it by up to the learning
    rate, on any plan.)"""
    import types
    from pathlib import Path
    from tests.helpers import assert_trees_close
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import gpt_megatron as M
    monkeypatch.setattr(M, "sp", types.SimpleNamespace(shard=lambda fn, *a, **k: fn))
    cfg = M.Config(layers=2, heads=4, head_dim=32, batch=16, seq=64, vocab=256)
    params = M.init_params(cfg)
    tokens, targets = M.make_batch(cfg)
    par = M.Parallelism(heads=None, columns=None)

    def loss_and_grads(params, tokens, targets):
        return jax.value_and_grad(M.loss_fn)(params, tokens, targets, par, cfg)
    pfn = sp.parallelize(loss_and_grads, mesh=((2, 4), ("dp", "mp")), mode="auto")
    plan = pfn.plan(params, tokens, targets)
    assert plan.cost.bytes_moved > 0                      # not everything replicated
    assert_trees_close(pfn(params, tokens, targets), jax.jit(loss_and_grads)(params, tokens, targets))


def test_layers_stacked_with_scan():
    """A scan over stacked weights is one decision (its summary rule); its body is then
    planned with the boundary pinned to the searched layouts."""
    def loss(ws, x, y):
        h, _ = jax.lax.scan(lambda h, w: (jax.nn.relu(h @ w), None), x, ws)
        return jnp.mean((h - y) ** 2)

    def step(ws, x, y):
        l, g = jax.value_and_grad(loss)(ws, x, y)
        return ws - 0.1 * g, l
    rng = np.random.default_rng(0)
    ws = (rng.standard_normal((4, 256, 256)) * 0.05).astype(np.float32)
    x, y = (rng.standard_normal((2048, 256)).astype(np.float32) for _ in range(2))
    pstep = sp.parallelize(step, mesh=((2, 4), ("dp", "mp")), mode="auto")
    assert pstep.plan(ws, x, y).counts().get("all_reduce", 0) >= 1      # batch split: gradients reduced
    assert_close(pstep(ws, x, y), jax.jit(step)(ws, x, y))


def _wire_bytes_per_step(graph, times: int = 1) -> float:
    """The lowered program's collectives' wire bytes, a scan's body once per trip."""
    from shardprop.ir.graph import is_collective
    from shardprop.passes.cost import trips
    total = 0.0
    for op in graph.ops:
        if is_collective(op) and op.kind != "slice":
            total += times * op.params.get("wire_bytes", 0)
        for body in op.subgraphs:
            total += _wire_bytes_per_step(body, times * trips(op))
    return total


def test_plan_cost_counts_a_scan_bodys_moves_on_every_trip():
    """The objective prices a loop by its summary rule and its boundary; plan.cost adds
    what its body moves on every trip, as the program is lowered (it had reported no
    bytes for a scanned Adam step whose backward body gathers on each of its 8 trips)."""
    from bench import zoo  # noqa: F401  (puts examples/ on the path)
    import gpt_megatron

    def loss(ws, x, y):
        h, _ = jax.lax.scan(lambda h, w: (jax.nn.relu(h @ w), None), x, ws)
        return jnp.mean((h - y) ** 2)
    step, opt = gpt_megatron.adam_train_step(loss)
    rng = np.random.default_rng(0)
    ws = (rng.standard_normal((8, 256, 256)) * 0.05).astype(np.float32)
    x, y = (rng.standard_normal((64, 256)).astype(np.float32) for _ in range(2))
    state = jax.tree_util.tree_map(np.asarray, opt.init(ws))
    plan = sp.parallelize(step, mesh=((2, 4), ("dp", "mp")), mode="auto", cost_model="cpu").plan(ws, state, x, y)
    cost = plan.cost
    bodies = cost.breakdown["(loop bodies)"]
    assert bodies["bytes"] > 0 and cost.solver["loop_bodies"] == bodies["communication"] > 0
    assert cost.bytes_moved == pytest.approx(_wire_bytes_per_step(plan.graph), rel=1e-9)
    assert cost.step_time == pytest.approx(cost.compute_time + cost.communication_time, rel=1e-12)
    assert cost.step_time == pytest.approx(cost.solver["claimed"] + cost.solver["loop_bodies"], rel=1e-9)


def test_auto_keeps_marks_as_constraints():
    def net(x, w1, w2):
        h = sp.shard(jnp.matmul, ((2, 4), (4, 1)))(x, w1)
        return jnp.matmul(jax.nn.relu(h), w2)
    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((16, 32), (32, 16), (16, 16)))
    p = sp.parallelize(net, mesh=8, mode="auto")
    np.testing.assert_allclose(np.asarray(p(x, w1, w2)), np.asarray(jax.jit(net)(x, w1, w2)), rtol=1e-5, atol=1e-5)
    plan = p.plan(x, w1, w2)
    first = next(o for o in plan.ops if o.primitive == "dot_general")
    assert first.in_strategy == ((2, 4), (4, 1))


# -- the plans a performance engineer would write -------------------------------------

def test_small_model_big_batch_is_data_parallel():
    params, x, y = problem_data(16384, 256, 2)
    pstep = sp.parallelize(sgd_step, mesh=8, mode="auto")
    plan = pstep.plan(params, x, y)
    mesh = plan.graph.mesh
    n = len(params)
    assert all(input_layout(plan, i).is_replicated() for i in range(n))          # weights replicated
    assert mesh.axes_size(input_layout(plan, n).dims[0]) == 8                    # batch over all 8 devices
    assert mesh.axes_size(input_layout(plan, n + 1).dims[0]) == 8
    assert plan.counts().get("all_reduce", 0) >= 1 and "all_gather" not in plan.counts()
    assert all(o.in_strategy[0][0] == 8 for o in plan.ops if o.primitive == "dot_general"
               and len(o.in_strategy[0]) == 2 and o.out_strategy[0][0] == 8)
    assert_close(pstep(params, x, y), jax.jit(sgd_step)(params, x, y))


@pytest.mark.slow
def test_weights_that_do_not_fit_get_split():
    params, x, y = problem_data(4096, 1024, 2)     # 4 MiB weights
    free = sp.parallelize(sgd_step, mesh=8, mode="auto").plan(params, x, y)
    n = len(params)
    assert any(free.graph.mesh.axes_size(input_layout(free, i).sharded_axes()) < 8 for i in range(n))
    limit = int(free.cost.peak_memory * 0.7)       # the unlimited plan's peak does not fit
    pstep = sp.parallelize(sgd_step, mesh=8, mode="auto", memory_limit=limit)
    plan = pstep.plan(params, x, y)
    mesh = plan.graph.mesh
    # the weights are split (which ones is the model's call: each is 4 MiB whole)
    held = sum(4 * 2**20 / mesh.axes_size(input_layout(plan, i).sharded_axes()) for i in range(n))
    assert all(free.graph.mesh.axes_size(input_layout(free, i).sharded_axes()) == 1 for i in range(n))
    assert held <= 0.75 * n * 4 * 2**20
    assert plan.cost.peak_memory <= limit < free.cost.peak_memory
    assert plan.cost.compiled_memory.total <= limit           # and so does the compiled program
    # (not how many memory rounds it took: under load the time budget ends them early, and
    # CI's loaded run returned a plan after one; the peak under a limit the free plan is over
    # is what shows the limit bound the search)
    assert plan.cost.memory_limit == limit
    assert plan.cost.step_time >= free.cost.step_time       # memory is paid for in time, never the reverse
    assert_close(pstep(params, x, y), jax.jit(sgd_step)(params, x, y))


def adam_step(params, state, x, y):
    import optax
    loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
    updates, state = optax.adam(1e-3).update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


def compiled_bytes(pstep, *args) -> int:
    """What XLA allocates per device for the step: arguments + outputs + temp - aliased."""
    m = pstep.lower(*args).compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes \
        + m.generated_code_size_in_bytes


@pytest.mark.slow
def test_state_that_overflows_gets_zero_style_sharding(caplog):
    import logging
    import optax
    params, x, y = problem_data(256, 512, 2)
    state = optax.adam(1e-3).init(params)
    args = (params, state, x, y)
    replicated = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves((params, state)))
    free = sp.parallelize(adam_step, mesh=8, mode="auto", donate_argnums=(0, 1))
    # binds: neither the unlimited plan's program nor the parameters and Adam's moments, whole, fit
    limit = int(min(compiled_bytes(free, *args), replicated) * 0.8)
    pstep = sp.parallelize(adam_step, mesh=8, mode="auto", memory_limit=limit, donate_argnums=(0, 1))
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        plan = pstep.plan(*args)
        out = pstep(*args)
    # the plan's check compiled the program the call runs: a plan that fits the first time compiles once
    compiles = [r for r in caplog.records if "XLA compilation of jit(body)" in r.getMessage()]
    assert len(compiles) == len([r for r in plan.cost.memory_checks if r.compiled is not None]) >= 1
    cost = plan.cost
    assert cost.step_time >= free.plan(*args).cost.step_time
    mesh = plan.graph.mesh
    names = plan.graph.input_names
    big = [i for i, v in enumerate(plan.graph.inputs) if v.type.nbytes >= 512 * 512 * 4 and i < len(names)
           and not names[i].startswith(("x", "y"))]
    assert len(big) == 6                                            # 2 weights, 2 first and 2 second moments
    assert all(mesh.axes_size(input_layout(plan, i).sharded_axes()) > 1 for i in big)   # every one split
    # the whole compiled program fits: arguments, outputs and XLA's scratch, as XLA reports them
    assert cost.compiled_memory.total == compiled_bytes(pstep, *args) <= limit
    assert cost.memory_limit == limit and cost.peak_memory <= cost.modeled_limit <= limit
    rounds = cost.memory_checks
    assert rounds[0].modeled_limit == limit and rounds[-1].compiled == cost.compiled_memory
    assert all(r.compiled is None or r.compiled.total > limit for r in rounds[:-1])
    # after a plan over the limit, the next search is held below that plan's modeled peak
    assert all(b.modeled_limit < a.modeled_peak for a, b in zip(rounds, rounds[1:]) if a.compiled is not None)
    assert "compiled per device" in str(cost)
    assert_close(out, jax.jit(adam_step)(params, state, x, y), tol=1e-4)


def xla_reports(monkeypatch, total, compiles=None):
    """The first ``compiles`` compiled programs (all if None) report ``total`` bytes per
    device, XLA's temp made up to it: a scratch the model cannot see, made certain."""
    from dataclasses import replace
    from shardprop.compiler import api
    real, seen = api.compiled_memory, []

    def reported(*a):
        m = real(*a)
        seen.append(m)
        return replace(m, temp=m.temp + total - m.total) if compiles is None or len(seen) <= compiles else m
    monkeypatch.setattr(api, "compiled_memory", reported)


def test_a_compiled_program_over_the_limit_is_searched_again_under_a_lower_modeled_limit(monkeypatch):
    params, x, y = problem_data(64, 512, 1)
    limit = 3 * 10 ** 6
    xla_reports(monkeypatch, limit + 100_000, compiles=1)     # the first plan's program is over by 0.1 MB
    pstep = sp.parallelize(sgd_step, mesh=8, mode="auto", memory_limit=limit)
    cost = pstep.plan(params, x, y).cost
    r1, r2 = cost.memory_checks
    assert r1.modeled_limit == limit and r1.compiled.total == limit + 100_000
    # searched again below the first plan's modeled peak by the excess
    assert r2.modeled_limit == min(limit, int(r1.modeled_peak) - 1) - 100_000 == cost.modeled_limit
    assert cost.peak_memory <= r2.modeled_limit and cost.compiled_memory.total <= limit
    assert cost.compiled_memory == r2.compiled and "memory round 2" in str(cost)
    assert_close(pstep(params, x, y), jax.jit(sgd_step)(params, x, y))


@pytest.mark.slow
def test_no_plan_whose_compiled_program_fits_is_a_sharding_error_with_the_figures(monkeypatch):
    params, x, y = problem_data(64, 512, 2)
    limit = 3 * 10 ** 6
    xla_reports(monkeypatch, 3 * limit)     # over by more than any plan models: no lower modeled limit helps
    pstep = sp.parallelize(sgd_step, mesh=8, mode="auto", memory_limit=limit)
    with pytest.raises(sp.ShardingError) as e:
        pstep.plan(params, x, y)
    msg = str(e.value)
    assert "no plan fits memory_limit=3,000,000 bytes per device once compiled" in msg
    assert "round 1: searched under modeled limit 3.00 MB: modeled peak" in msg and "compiled 9.00 MB" in msg
    assert "+ temp" in msg and "largest tensors" in msg and "raise memory_limit" in msg


def test_modeled_limits_step_below_the_excess_then_halve_back_up():
    from shardprop.compiler.memory_check import MAX_ROUNDS, CompiledMemory, MemoryRound, ModeledLimits
    limit = 10_000_000
    limits = ModeledLimits(limit)
    limits.add(MemoryRound(limit, 9_000_000, CompiledMemory(6_000_000, 0, 6_000_000, 0, 0)))   # over by 2 MB
    assert limits.next() == 9_000_000 - 1 - 2_000_000          # below that plan's peak by the excess
    limits.add(MemoryRound(6_999_999))                           # no plan models under it
    assert limits.next() == (6_999_999 + 8_999_999) // 2       # halfway back up to the plan that was over
    limits.add(MemoryRound(7_999_999))
    assert limits.next() == (7_999_999 + 8_999_999) // 2
    while len(limits.rounds) < MAX_ROUNDS:
        limits.add(MemoryRound(limits.next()))
    assert limits.next() is None                                 # the rounds are spent
    hopeless = ModeledLimits(limit)
    hopeless.add(MemoryRound(limit, 5_000_000, CompiledMemory(0, 0, 3 * limit, 0, 0)))
    assert hopeless.next() is None            # over by more than the plan models: no modeled limit helps


def test_a_gather_along_a_minor_dim_holds_its_result_twice():
    """XLA gathers along the major dim and copies into row-major: a weight split on its
    columns and gathered whole is held twice while that runs; split on rows, once."""
    from shardprop.ir.graph import TensorType, Value
    from shardprop.ir.layout import Layout
    from shardprop.passes.auto.memory import copy_bytes
    mesh = Mesh(("a",), (8,))
    w = Value(TensorType((1024, 1024), "float32"))
    whole = 1024 * 1024 * 4
    assert copy_bytes(w, Layout(((), ("a",))), Layout.replicated(2), mesh) == 2 * whole
    assert copy_bytes(w, Layout((("a",), ())), Layout.replicated(2), mesh) == whole
    assert copy_bytes(w, Layout.replicated(2), Layout.replicated(2), mesh) == 0


def test_modeled_peak_counts_redistribution_copies():
    from shardprop.ir.layout import Layout
    from shardprop.passes.auto.memory import copy_bytes, local_bytes, plan_peak, plan_profile
    params, x, y = problem_data(64, 512, 1)
    g = SearchStrategies()(traced_graph(sgd_step, (params, x, y), Mesh(("a", "b"), (2, 4)), tied=(0,)))
    mesh = g.mesh
    ops = {op: op.strategy for op in g.ops}
    inputs = {i: v.layout for i, v in enumerate(g.inputs)}
    base = plan_profile(g, ops, inputs)
    assert plan_peak(g, ops, inputs) == base.max() == pytest.approx(g.auto.peak_memory)
    # the weight arrives in another layout: a copy in the layout each reader needs (as
    # much as its redistribution holds: copy_bytes) is alive at that reader, and only there
    w, old = g.inputs[0], inputs[0]
    new = Layout((tuple(mesh.axis_names), ()))
    new = new if new != old else Layout.replicated(2)
    moved = plan_profile(g, ops, {**inputs, 0: new})
    want = base + local_bytes(w, new, mesh) - local_bytes(w, old, mesh)
    readers = 0
    for t, op in enumerate(g.ops):
        for m, v in enumerate(op.inputs):
            if v is w:
                need = op.strategy.operand_layout(m, 2, mesh)
                want[t + 1] += copy_bytes(w, new, need, mesh) - copy_bytes(w, old, need, mesh)
                readers += need != new
    assert readers >= 1
    np.testing.assert_allclose(moved, want)


def test_cost_and_explain(tmp_path):
    params, x, y = problem_data(2048, 256, 2)
    plan = sp.parallelize(sgd_step, mesh=((2, 4), ("dp", "mp")), mode="auto").plan(params, x, y)
    cost = plan.cost
    assert cost.step_time == pytest.approx(cost.compute_time + cost.communication_time)
    assert cost.step_time > 0 and cost.flops > 0 and cost.peak_memory > 0
    assert cost.bytes_moved == pytest.approx(sum(b["bytes"] for b in cost.breakdown.values()))
    assert cost.breakdown["dot_general"]["compute"] > 0
    text = plan.explain()
    assert "chosen" in text and "rejected" in text and "dot_general" in text
    # each decision's rejected alternative is no cheaper than the plan (the plan is optimal)
    for d in cost.decisions:
        assert d.rejected_time is None or d.rejected_time >= d.chosen_time * (1 - 1e-9)
    # the model's bytes are what the compiled plan moves
    assert cost.bytes_moved == pytest.approx(plan.bytes, rel=0.01)
    # the dumps carry the same explanation
    plan.dump(str(tmp_path))
    assert (tmp_path / "search.txt").read_text().strip() == text


# -- quality against the exact ILP -----------------------------------------------------

def traced_graph(fn, args, mesh: Mesh, tied=()):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    g = import_jaxpr(closed, mesh, input_names(fn, args, {}), "fn")
    if tied:
        g.tied_outputs = state_ties(args, tied, out_shape)
    return BindUserStrategies()(g)


def row_lp(frac=0.7):
    """A 2-layer SGD step on 2 x 4 with one memory row at ``frac`` of the unlimited LP
    plan's peak: the problem, its liveness, reduction, warm model, row, limit, LP and the
    point the row is at."""
    from shardprop.passes.auto import milp, warm_lp
    from shardprop.passes.auto.problem import Problem
    from shardprop.passes.auto.search import _Liveness
    from shardprop.passes.cost import DEFAULT_COST
    params, x, y = problem_data(256, 64, 2)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("dp", "mp"), (2, 4)), tied=(0,))
    problem = Problem(g, DEFAULT_COST)
    memory = _Liveness(g, problem)
    red = milp.reduce(problem, memory_matters=True)
    model = warm_lp.WarmLP(red)
    peak, at = memory.peak(model.solve().choice)
    rows, limit = [memory.row(at)], frac * peak
    lp = model.solve(red.kept, rows, limit)
    assert lp.rounded   # (fractional: what the dive is for)
    return problem, memory, red, model, rows, limit, lp, at


@pytest.mark.parametrize("layers,batch,width,mesh", [
    (2, 8192, 256, (2, 4)), (3, 64, 1024, (2, 4)), (4, 2048, 512, (2, 4)),
    # 1.3-2.9% above the exact ILP before refinement moved an op with what follows it and
    # offered free slices, and before stacks of up to 6 layers kept a decision per layer
    (2, 2048, 512, (4, 2)), (2, 256, 2048, (4, 2)), (4, 256, 2048, (2, 4))])
def test_plan_within_one_percent_of_the_exact_ilp(layers, batch, width, mesh):
    params, x, y = problem_data(batch, width, layers)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("a", "b"), mesh), tied=(0,))
    exact = Problem(g, DEFAULT_COST, follow=False, share_layers=False)
    coarse = Problem(g, DEFAULT_COST)
    assert len(coarse.unary) < len(exact.unary)          # the coarsening did something
    exact_sol = milp.solve(milp.reduce(exact, False))
    _, planned, _ = SearchStrategies().search(g)         # what mode="auto" plans
    _, coarse_sol, _ = SearchStrategies(exact_ops=0).search(g)   # the coarse problem alone (solve, then refine)
    e = exact.evaluate(*exact.op_strategies(exact_sol.choice))
    p = exact.evaluate(*planned.plan)
    c = exact.evaluate(*coarse_sol.plan)                 # the coarse plan priced op by op
    e_time, c_time = e["compute"] + e["communication"], c["compute"] + c["communication"]
    assert e_time == pytest.approx(exact.objective(exact_sol.choice), rel=1e-9)   # the ILP prices a plan as the walk does
    # graphs this small are also solved without coarsening (search.EXACT_OPS): auto's plan is the optimum or better
    # (refinement may reach an axis order the ILP's candidates leave out)
    assert p["compute"] + p["communication"] <= e_time * (1 + 1e-9)
    # the coarsening, which plans larger graphs: within 1% on all but one of these (2048 x 512, 2 layers, 4 x 2:
    # 2.35% above since terminal values are priced at the step's end, 2026-11-26; the forward's ReLU mask follows
    # its matmul, which the exact plan leaves whole while it slices the mask)
    assert c_time <= e_time * 1.025


@pytest.mark.parametrize("batch,width,layers,mesh", [(8192, 512, 2, (2, 4)), (2048, 256, 2, (2, 4)),
                                                      (2048, 512, 3, (2, 4)), (256, 2048, 4, (4, 2))])
def test_adam_plan_near_the_exact_ilp(batch, width, layers, mesh):
    """Adam reads each weight gradient twice (its two moments): the transpose that passes
    the gradient on, partial, decides for itself, so it is completed once for both
    readers. (While it followed the gradient's matmul the plan was 28% / 11% above the
    exact ILP's on the first two; then 0% / 3.4%, the second from ReLU's backward select
    following the forward activation's mask, which now decides where the two matmuls'
    values meet; the last two were 2.3% / 1.6% above it.)"""
    import optax
    params, x, y = problem_data(batch, width, layers)
    g = traced_graph(adam_step, (params, optax.adam(1e-3).init(params), x, y), Mesh(("a", "b"), mesh), tied=(0, 1))
    exact = Problem(g, DEFAULT_COST, follow=False, share_layers=False)
    e = exact.evaluate(*exact.op_strategies(milp.solve(milp.reduce(exact, False)).choice))
    _, coarse, _ = SearchStrategies(exact_ops=0).search(g)   # the coarse problem alone, as larger graphs are planned
    c = exact.evaluate(*coarse.plan)
    assert c["compute"] + c["communication"] <= (e["compute"] + e["communication"]) * 1.01


def test_repeated_layers_share_variables():
    """Layers between the first and the last share one set of variables: the problem's
    size does not grow with depth."""
    sizes = {}
    for layers in (8, 12):
        params, x, y = problem_data(256, 64, layers)
        g = traced_graph(sgd_step, (params, x, y), Mesh(("a", "b"), (2, 4)), tied=(0,))
        sizes[layers] = len(Problem(g, DEFAULT_COST).unary), len(Problem(g, DEFAULT_COST, share_layers=False).unary)
    assert sizes[8][0] == sizes[12][0]
    assert sizes[12][1] > sizes[8][1] > sizes[8][0]


# -- exact shortcuts of the search (speed without changing the plan) -----------------

def random_problem(rng, nodes, edges, cands=(2, 7)):
    """A random reduced problem: costs per candidate, edges between random pairs of
    nodes (several between one pair too) with layout classes."""
    from shardprop.passes.auto.problem import Edge
    unary = {t: rng.random(rng.integers(*cands)) for t in range(nodes)}
    out = []
    for a, b in edges:
        rows = rng.integers(0, 3, len(unary[a]))
        cols = rng.integers(0, 3, len(unary[b]))
        out.append(Edge(a, b, rows, cols, rng.random((3, 3))))
    return milp.Reduced(unary, out, {t: np.arange(len(u)) for t, u in unary.items()})


def test_edges_between_the_same_two_decisions_are_one_edge_and_the_lp_cannot_pair_them_apart():
    """Two edges between one pair of decisions, by other layout classes: apart, the LP
    relaxation prices each at another pairing (here 0, where every plan costs 10);
    joined into one edge classed by both (the same cost for every pair of candidates),
    its bound is the optimum. The problem keeps one edge per pair of decisions."""
    from shardprop.passes.auto.problem import Edge, _joined
    same = np.array([[0.0, 10.0], [10.0, 0.0]])
    apart = [Edge(0, 1, np.array([0, 1]), np.array([0, 1]), same),
             Edge(0, 1, np.array([0, 1]), np.array([1, 0]), same)]
    one = _joined(apart)
    assert np.array_equal(one.dense(), sum(e.dense() for e in apart))
    kept = {0: np.arange(2), 1: np.arange(2)}
    unary = {0: np.zeros(2), 1: np.zeros(2)}
    loose = milp.solve(milp.Reduced(unary, apart, kept), relax=True, exact_dp=False)
    tight = milp.solve(milp.Reduced(unary, [one], kept), relax=True, exact_dp=False)
    assert loose.bound == pytest.approx(0.0, abs=1e-12) and loose.rounded
    assert tight.bound == pytest.approx(10.0) and evaluate_reduced(milp.Reduced(unary, apart, kept), tight.choice) == 10.0
    rng = np.random.default_rng(0)
    for _ in range(20):   # (random classes: the joined edge prices every pair as the sum)
        k_a, k_b = rng.integers(2, 9, 2)
        edges = [Edge(0, 1, rng.integers(0, 3, k_a), rng.integers(0, 4, k_b), rng.random((3, 4))) for _ in range(3)]
        j = _joined(edges)
        assert np.allclose(j.dense(), sum(e.dense() for e in edges))
        assert j.cost.shape[0] <= k_a and j.cost.shape[1] <= k_b
    params, x, y = problem_data(256, 64, 2)
    problem = Problem(traced_graph(sgd_step, (params, x, y), Mesh(("a", "b"), (2, 4)), tied=(0,)), DEFAULT_COST)
    pairs = [(e.a, e.b) for e in problem.edges]
    assert len(pairs) == len(set(pairs))


def test_exact_dp_solves_a_chain_without_the_milp():
    """A chain folds up entirely by elimination; the plan's cost is the MILP's optimum."""
    rng = np.random.default_rng(0)
    red = random_problem(rng, 30, [(i, i + 1) for i in range(29)] + [(3, 4)])
    dp = milp.solve(red)
    full = milp.solve(red, exact_dp=False)
    assert dp.variables == 0 and "elimination" in dp.status
    assert dp.objective == pytest.approx(full.objective, rel=1e-12)
    assert evaluate_reduced(red, dp.choice) == pytest.approx(full.objective, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_exact_dp_then_milp_keeps_the_optimum_on_graphs_with_cycles(seed):
    rng = np.random.default_rng(seed)
    n = 14
    pairs = [(i, i + 1) for i in range(n - 1)] + [tuple(sorted(rng.choice(n, 2, replace=False))) for _ in range(8)]
    red = random_problem(rng, n, pairs)
    dp = milp.solve(red)
    full = milp.solve(red, exact_dp=False)
    assert dp.variables < full.variables
    assert evaluate_reduced(red, dp.choice) == pytest.approx(evaluate_reduced(red, full.choice), rel=1e-12)
    assert dp.objective == pytest.approx(full.objective, rel=1e-12)


def test_exact_dp_never_grows_the_milp():
    """A decision with few candidates between two with many is kept: the edge eliminating
    it would make (every pair of theirs) holds more pair variables than the two it replaces."""
    from shardprop.passes.auto.problem import Edge
    rng = np.random.default_rng(1)
    unary = {0: rng.random(30), 1: rng.random(3), 2: rng.random(30), 3: rng.random(4), 4: rng.random(4)}
    edges = [Edge(0, 1, np.arange(30), np.arange(3), rng.random((30, 3))),
             Edge(1, 2, np.arange(3), np.arange(30), rng.random((3, 30)))]
    for a, b in ((0, 2), (0, 3), (0, 4), (2, 3), (2, 4), (3, 4)):   # 0, 2, 3, 4: each has three neighbours
        edges.append(Edge(a, b, np.arange(len(unary[a])) % 2, np.arange(len(unary[b])) % 2, rng.random((2, 2))))
    red = milp.Reduced(unary, edges, {t: np.arange(len(u)) for t, u in unary.items()})
    dp, full = milp.solve(red), milp.solve(red, exact_dp=False)
    assert dp.variables <= full.variables and "eliminated" not in dp.status
    assert evaluate_reduced(red, dp.choice) == pytest.approx(evaluate_reduced(red, full.choice), rel=1e-12)


def test_an_impossible_move_does_not_blind_the_solver():
    """Prices are seconds (a step here is ~1e-4 s); an impossible move is priced 1e6 s.
    Scaled together, every real price fell under HiGHS's tolerances and the solver
    returned an arbitrary plan it called optimal. Impossible pairs are excluded instead."""
    from shardprop.passes.auto.problem import Edge
    from shardprop.passes.cost import IMPOSSIBLE
    rng = np.random.default_rng(3)
    n = 12
    unary = {t: rng.random(6) * 1e-4 for t in range(n)}
    edges = []
    for a in range(n):
        for b in (a + 1, a + 3):
            if b < n:
                cost = rng.random((3, 3)) * 1e-4
                cost[0, 1] = IMPOSSIBLE
                edges.append(Edge(a, b, np.arange(6) % 3, (np.arange(6) + a) % 3, cost))
    red = milp.Reduced(unary, edges, {t: np.arange(6) for t in range(n)})
    best = min(evaluate_reduced(red, dict(enumerate(c))) for c in _random_choices(rng, n, 6, 3000))
    for exact_dp in (True, False):
        sol = milp.solve(red, exact_dp=exact_dp)
        got = evaluate_reduced(red, sol.choice)
        assert got < 1.0 and got <= best + 1e-12      # no impossible move, and no worse than 3,000 random plans
        assert sol.objective == pytest.approx(got, rel=1e-9)


def _random_choices(rng, n, k, count):
    return rng.integers(0, k, (count, n))


def test_a_sum_of_partials_is_completed_once():
    """x @ w1 + x @ w2 with both contractions split: the search itself adds the two
    partial sums and completes the result once, and prices it so (where the add could
    only follow one operand, it priced an all_reduce per operand and left the merge to
    sink-reductions, so its objective overstated such plans)."""
    def f(x, w1, w2):
        return x @ w1 + x @ w2
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 1 << 18), dtype=np.float32)
    w1, w2 = (rng.standard_normal((1 << 18, 3), dtype=np.float32) for _ in range(2))
    g = traced_graph(f, (x, w1, w2), Mesh(("a",), (8,)))
    problem = Problem(g, DEFAULT_COST)
    add = next(op for op in g.ops if op.kind == "add")
    assert add in problem.partial_sums
    sol = milp.solve(milp.reduce(problem, False))
    ops, _ = problem.op_strategies(sol.choice)
    assert ops[add].passthrough is not None and ops[add].result_layout(0, g.mesh).partial == ("a",)
    assert all(ops[op].result_layout(0, g.mesh).partial == ("a",) for op in g.ops if op.kind == "dot_general")
    pf = sp.parallelize(f, mesh=8, mode="auto")
    plan = pf.plan(x, w1, w2)
    assert plan.counts().get("all_reduce", 0) + plan.counts().get("reduce_scatter", 0) == 1, plan.counts()
    assert plan.cost.solver["objective"] == pytest.approx(plan.cost.step_time, rel=1e-6)
    assert_close(pf(x, w1, w2), jax.jit(f)(x, w1, w2))


def evaluate_reduced(red, choice):
    return (sum(red.unary[t][k] for t, k in choice.items())
            + sum(e.at(choice[e.a], choice[e.b]) for e in red.edges))


def _memory_problem(seed, n=10, k=4):
    """A random search problem (costs ~1e-4 s) with two memory rows: per-decision bytes
    and, in the second, a copy between two decisions."""
    from shardprop.passes.auto.problem import Edge
    rng = np.random.default_rng(seed)
    unary = {t: rng.random(k) * 1e-4 for t in range(n)}
    edges = [Edge(a, b, np.arange(k) % 2, np.arange(k) % 2, rng.random((2, 2)) * 1e-4)
             for a in range(n) for b in (a + 1, a + 2) if b < n]
    red = milp.Reduced(unary, edges, {t: np.arange(k) for t in range(n)})
    # cheaper candidates hold more bytes: the limit trades time for memory
    rows = [milp.MemoryRow({t: (1.5e-4 - unary[t]) * 1e10 + rng.random(k) * 2e5 for t in range(n)}),
            milp.MemoryRow({t: (1.5e-4 - unary[t]) * 2e10 for t in range(0, n, 2)},
                           [(1, 3, np.arange(k), np.arange(k), rng.random((k, k)) * 1e6)])]
    return red, rows


@pytest.mark.parametrize("seed", range(6))
def test_lagrange_multipliers_bound_the_optimum_and_their_plan_fits(seed):
    """The multipliers' lower bound is below the exact rows' optimum, their plan fits every
    row (on some seeds the second row binds too), and the gap they report is a true one."""
    from shardprop.passes.auto import lagrange
    red, rows = _memory_problem(seed)

    def peak(choice):
        held = [lagrange.row_bytes(r, choice) for r in rows]
        return max(held), int(np.argmax(held))
    free = milp.solve(red).choice
    limit = 0.85 * peak(free)[0]
    exact = milp.solve(red, rows, limit)
    assert exact.choice and peak(exact.choice)[0] <= limit
    optimum = evaluate_reduced(red, exact.choice)
    out = lagrange.search(red, lambda c: evaluate_reduced(red, c), peak, lambda at: rows[at], limit, tolerance=0.05)
    assert out.bound <= optimum * (1 + 1e-7)
    assert out.choice is not None and peak(out.choice)[0] <= limit
    assert out.objective == pytest.approx(evaluate_reduced(red, out.choice), rel=1e-12) and out.objective >= optimum * (1 - 1e-9)
    assert out.gap == pytest.approx((out.objective - out.bound) / out.objective)


def test_multipliers_out_of_time_return_what_they_met(monkeypatch):
    """A priced solve that runs out of time before any plan ends the multipliers with the
    plans and rows met so far (the search briefly gives them 1 s), not with an error;
    they start from the rows given."""
    from shardprop.passes.auto import lagrange
    red, rows = _memory_problem(0)

    def peak(choice):
        held = [lagrange.row_bytes(r, choice) for r in rows]
        return max(held), int(np.argmax(held))
    limit = 0.85 * peak(milp.solve(red).choice)[0]
    solve, calls = milp.solve, []

    def once(*a, **k):
        calls.append(1)
        if len(calls) > 1:
            raise sp.ShardingError("the strategy search found no plan within its time limit of 1 s")
        return solve(*a, **k)
    monkeypatch.setattr(milp, "solve", once)
    out = lagrange.search(red, lambda c: evaluate_reduced(red, c), peak, lambda at: rows[at], limit,
                          rows=rows[:1])
    assert len(calls) == 2 and out.iterations == 2 and out.rows[0] is rows[0]
    assert out.history and out.smallest is not None


@pytest.mark.slow
def test_multipliers_and_exact_rows_plan_alike_under_a_limit():
    """The MLP step whose weights do not fit: multipliers first (exact rows where they
    leave a gap above 1%) plan within 1% of the exact rows' plan, and fit."""
    params, x, y = problem_data(4096, 1024, 2)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("a", "b"), (2, 4)), tied=(0,))
    _, free, _ = SearchStrategies().search(g)
    limit = int(free.peak * 0.7)
    _, exact, exact_peak = SearchStrategies(memory_limit=limit, memory_method="exact").search(g)
    _, lag, lag_peak = SearchStrategies(memory_limit=limit, memory_method="lagrange").search(g)
    assert exact_peak <= limit and lag_peak <= limit
    assert lag.objective <= exact.objective * 1.01
    assert lag.bound <= exact.objective * (1 + 1e-4)   # (a solver's bound holds the 1e-16 s/byte tie-break)


@pytest.mark.slow
def test_exact_rows_out_of_time_leave_the_multipliers_plan(monkeypatch):
    """Where the exact rows find no plan within their time limit (simulated), the
    multipliers' plan that fits is returned with its gap, not an error (with either
    memory method); where the multipliers find none either, the time limit's error."""
    params, x, y = problem_data(4096, 1024, 2)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("a", "b"), (2, 4)), tied=(0,))
    _, free, _ = SearchStrategies().search(g)
    limit = int(free.peak * 0.7)
    solve = milp.solve

    def out_of_time(red, memory_rows=(), *a, **k):
        if memory_rows:
            raise sp.ShardingError("the strategy search found no plan within its time limit of 1 s")
        return solve(red, memory_rows, *a, **k)
    monkeypatch.setattr(milp, "solve", out_of_time)
    # (and neither rounding nor diving the rows' LP gives a plan, so the exact rows are what decide)
    from shardprop.passes.auto import search
    monkeypatch.setattr(search, "_roundings", lambda *a, **k: [])
    monkeypatch.setattr(search, "_dive", lambda *a, **k: None)
    for method in ("exact", "lagrange"):
        _, sol, peak = SearchStrategies(memory_limit=limit, memory_method=method, memory_tolerance=0.0).search(g)
        assert peak <= limit and "the exact rows found no plan within their time limit" in sol.status
        assert 0 < sol.gap < 1 and sol.bound <= sol.objective
    with pytest.raises(sp.ShardingError, match="time limit"):   # a limit no plan fits: nothing to return
        SearchStrategies(memory_limit=int(free.peak * 0.01)).search(g)


def test_memory_method_is_checked():
    with pytest.raises(sp.ShardingError, match="memory_method='fast'"):
        SearchStrategies(memory_method="fast")


def test_exact_dp_on_the_search_problem_gives_the_same_plan():
    params, x, y = problem_data(2048, 512, 4)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("a", "b"), (2, 4)), tied=(0,))
    for problem in (Problem(g, DEFAULT_COST), Problem(g, DEFAULT_COST, follow=False, share_layers=False)):
        red = milp.reduce(problem, False)
        dp, full = milp.solve(red), milp.solve(red, exact_dp=False)
        assert "eliminated exactly" in dp.status and dp.variables < full.variables
        assert problem.objective(dp.choice) == pytest.approx(problem.objective(full.choice), rel=1e-12)


def test_prices_are_shared_across_arrangements_and_exact():
    """One price per virtual problem: a move on 2 x 4 and its twin on 4 x 2 are priced
    once, and every price is what the planner itself says, with the default model
    (groups priced by size) and with a profile (groups priced by the ranks they span)."""
    from shardprop.ir.layout import Layout
    from shardprop.passes.auto.candidates import tensor_layouts
    from shardprop.passes.plan_core.pricing import Prices
    from shardprop.passes.cost import CostModel
    from shardprop.passes.redistribute import redistribution_cost
    shape = (8, 16, 4)
    for cost in (DEFAULT_COST, CostModel.builtin("cpu")):
        prices, asked = Prices(cost, True), 0
        for sizes in ((2, 4), (4, 2)):
            mesh = Mesh(("d0", "d1"), sizes)
            dsts = tensor_layouts(shape, mesh)
            srcs = dsts + [Layout(l.dims, tuple(a for a in mesh.axis_names if a not in l.sharded_axes()))
                           for l in dsts if len(l.sharded_axes()) < 2]
            for src in srcs:
                for dst in dsts:
                    if src != dst:
                        asked += 1
                        assert prices(shape, 4, src, dst, mesh) == redistribution_cost(shape, 4, src, dst, mesh,
                                                                                      True, cost)
        if cost is DEFAULT_COST:   # (a profile's groups on 2 x 4 and 4 x 2 span other ranks: priced apart)
            assert len(prices._by_virtual) < asked * 0.75


def test_a_second_arrangement_reuses_the_nodes_and_prices_alike():
    params, x, y = problem_data(512, 256, 3)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("d0", "d1"), (2, 4)), tied=(0,))
    first = Problem(g, DEFAULT_COST)
    g.set_mesh(Mesh(("d0", "d1"), (4, 2)))
    fresh, reused = Problem(g, DEFAULT_COST), Problem(g, DEFAULT_COST, prices=first.prices, like=first)
    assert reused.owner is first.owner
    assert [n.template for n in reused.nodes] == [n.template for n in fresh.nodes]
    for t in fresh.unary:
        np.testing.assert_array_equal(reused.unary[t], fresh.unary[t])
    assert [(e.a, e.b) for e in reused.edges] == [(e.a, e.b) for e in fresh.edges]
    for e, f in zip(reused.edges, fresh.edges):
        np.testing.assert_array_equal(e.dense(), f.dense())


# -- bad input ----------------------------------------------------------------------

def test_memory_limit_text():
    assert parse_memory_limit("12MB") == 12 * 10 ** 6
    assert parse_memory_limit("16GiB") == 16 * 2 ** 30
    assert parse_memory_limit(" 1.5 KiB ") == 1536
    assert parse_memory_limit(4096) == 4096
    assert parse_memory_limit(None) is None


@pytest.mark.parametrize("bad", ["12 parsecs", "GB", "-3MB", "", 0, True, 1.5j])
def test_malformed_memory_limit_is_a_sharding_error(bad):
    with pytest.raises(sp.ShardingError, match="memory_limit"):
        sp.parallelize(sgd_step, mesh=8, mode="auto", memory_limit=bad)


def test_memory_limit_outside_auto_is_an_error():
    with pytest.raises(sp.ShardingError, match="mode='auto'"):
        sp.parallelize(sgd_step, mesh=8, memory_limit="1GB")


def test_impossible_memory_limit_names_the_peak_and_the_tensors():
    params, x, y = problem_data(1024, 256, 2)
    pstep = sp.parallelize(sgd_step, mesh=8, mode="auto", memory_limit="10KB")
    with pytest.raises(sp.ShardingError) as e:
        pstep.plan(params, x, y)
    msg = str(e.value)
    assert "no plan fits memory_limit=10,000 bytes" in msg and "smallest modeled peak found" in msg
    assert "(1024, 256)" in msg or "(256, 256)" in msg     # the tensors that dominate it, by shape


def test_no_plan_fits_reports_no_peak_above_a_plan_it_met():
    """The smallest peak the error names is at most every plan's the search met: on a 1-D
    model-parallel mesh the fewest bytes per decision peaked above the free plan's, and
    the error named that instead (bench/zoo.py's megatron_mlp, 1.54 against 0.95 MB)."""
    from jax.sharding import AxisType
    from jax.sharding import Mesh as JaxMesh

    def block(x, w1, w2):
        return x + jax.nn.gelu(x @ w1) @ w2
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64, 256)).astype(np.float32)
    w1 = (rng.standard_normal((256, 1024)) * 0.05).astype(np.float32)
    w2 = (rng.standard_normal((1024, 256)) * 0.05).astype(np.float32)
    mesh = JaxMesh(np.array(jax.devices()[:8]), ("mp",), axis_types=(AxisType.Auto,))
    free = sp.parallelize(block, mesh=mesh, mode="auto", cost_model="cpu").plan(x, w1, w2)
    # the leanest plan there is (Megatron's, a hand plan every limited search meets), and
    # a limit under it
    lean = sp.parallelize(block, mesh=mesh, mode="auto", cost_model="cpu",
                          memory_limit=int(0.6 * free.cost.peak_memory)).plan(x, w1, w2)
    limit = int(0.9 * lean.cost.peak_memory)
    with pytest.raises(sp.ShardingError) as e:
        sp.parallelize(block, mesh=mesh, mode="auto", cost_model="cpu", memory_limit=limit).plan(x, w1, w2)
    found = int(str(e.value).split("smallest modeled peak found is ")[1].split(" bytes")[0].replace(",", ""))
    assert limit < found <= lean.cost.peak_memory


def test_missing_solver_is_a_sharding_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)   # import scipy.optimize now fails
    params, x, y = problem_data(64, 64, 1)
    with pytest.raises(sp.ShardingError, match="scipy"):
        sp.parallelize(sgd_step, mesh=8, mode="auto").plan(params, x, y)


def test_a_short_stack_of_large_blocks_is_one_set_of_decisions_and_of_small_blocks_one_per_layer():
    """Two repetitions of a block of many ops (a transformer layer: 40-113 ops per period in
    the GPT step) share one set of decisions, as an engineer plans every layer alike: the
    problem does not grow with depth (the 2-layer GPT step's search took half the time, to
    the same or cheaper plans). Two of a block of a few ops (an MLP's layer) keep a
    decision each: there the first and last layers' other needs matter (a 3-layer SGD MLP
    planned alike was 20% above the exact ILP)."""
    from shardprop.passes.auto.problem import SHARED_FROM, SHARED_PERIOD, _repeat_map
    big, small = list(range(SHARED_PERIOD)), list(range(100, 100 + SHARED_PERIOD // 2))
    head = len(big) * 2 + 1
    out = _repeat_map([-1] + big * 2 + [-2] + small * 2 + [-3] + small * SHARED_FROM)
    assert {i: out[i] for i in range(1 + len(big), head)} == {1 + len(big) + i: 1 + i for i in range(len(big))}
    assert not any(head + 1 + i in out for i in range(2 * len(small)))      # (each small layer its own)
    deep = head + 2 + 2 * len(small)
    assert all(out[deep + len(small) * r + i] == deep + i for r in range(1, SHARED_FROM) for i in range(len(small)))

    def block(h, w):   # one layer of SHARED_PERIOD ops and more
        for _ in range(SHARED_PERIOD // 2):
            h = jnp.tanh(h) * 0.5 + h
        return h @ w

    def net(ws, x):
        for w in ws:
            x = block(x, w)
        return x.sum()

    def decisions(layers, f):
        ws = [np.ones((16, 16), np.float32)] * layers
        return len(Problem(traced_graph(f, (ws, np.ones((8, 16), np.float32)), Mesh(("a", "b"), (2, 4))),
                           DEFAULT_COST).unary)
    assert decisions(2, net) == decisions(3, net) == decisions(5, net)
    small_net = lambda ws, x: sum((x @ w).sum() for w in ws)   # noqa: E731 (a few ops per layer)
    assert decisions(2, small_net) < decisions(3, small_net)


@pytest.mark.parametrize("marked", [False, True])
def test_the_searchs_peak_by_layout_classes_is_the_program_walks(monkeypatch, marked):
    """``_Liveness.profile`` sums each value's and each copy's bytes by the choice's layout
    classes instead of walking the program (``memory.plan_profile``): on random plans of
    a GPT step (attention's views and fused reads, layer norms, the tied head, Adam), every
    point's bytes are the walk's, and a plan with one decision switched (``switched``)
    is summed from the last profile to the same bytes. With a mark whose request gathers
    a stored value (each reader gathers it at its own use, which the terms do not hold)
    it walks."""
    import types
    from pathlib import Path
    from shardprop.passes.auto.memory import plan_profile
    from shardprop.passes.auto.search import _Liveness
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import gpt_megatron as M
    import optax
    if not marked:
        monkeypatch.setattr(M, "sp", types.SimpleNamespace(shard=lambda fn, *a, **k: fn))
    cfg = M.Config(layers=2, heads=4, head_dim=8, batch=8, seq=16, vocab=64)
    par = M.Parallelism.data_and_tensor() if marked else M.Parallelism(heads=None, columns=None)
    step, opt = M.make_train_step(par, cfg)
    params = M.init_params(cfg)
    tokens, targets = M.make_batch(cfg)
    mesh = Mesh(("dp", "mp"), (2, 4))
    g = traced_graph(step, (params, opt.init(params), tokens, targets), mesh, tied=(0, 1))
    problem = Problem(g, DEFAULT_COST)
    live = _Liveness(g, problem)
    assert (live._held_terms is None) == marked
    rng = np.random.default_rng(0)
    for trial in range(12):
        choice = {t: int(rng.integers(len(u))) if trial else 0 for t, u in problem.unary.items()}
        walked = plan_profile(g, *problem.op_strategies(choice), live.facts)
        np.testing.assert_allclose(live.profile(choice), walked, rtol=1e-12, atol=0)
        # one decision switched, from this profile (repair.py's trials): only the terms of
        # that decision are summed again, and the result is the whole profile's, exactly
        prof = live.profile(choice)
        for t in rng.choice(list(choice), size=6, replace=False):
            k = int(rng.integers(len(problem.unary[t])))
            np.testing.assert_array_equal(live.switched(choice, prof, t, k), live.profile({**choice, t: k}))
