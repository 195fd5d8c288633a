"""The planner substrate (passes/plan_core) both engines stand on.

One evaluator prices a whole plan; each engine's own figure for the plan it chose
must be that number, so propagation, the search's objective, its refinement and
``plan.cost`` cannot drift apart again: every zoo case (bench/zoo.py), both engines.
"""
import jax.numpy as jnp
import numpy as np
import pytest

import shardprop as sp
from bench import zoo
from shardprop.ir.layout import Layout
from shardprop.ir.mesh import Mesh
from shardprop.passes.auto import SearchStrategies
from shardprop.passes.bind_strategies import BindUserStrategies
from shardprop.passes.cost import DEFAULT_COST, ComputeTimes, StepEnd
from shardprop.passes.fusion import resident_values
from shardprop.passes.plan_core.context import PlanContext, RuleBook
from shardprop.passes.plan_core.evaluate import evaluate_plan
from shardprop.passes.plan_core.improve import best_move
from shardprop.passes.plan_core.pricing import Prices
from shardprop.passes.propagate import PropagateSharding
from shardprop.passes.redistribute import redistribution_cost

SLOW = {"gpt12_train_mp8", "gpt12_train_dp2xmp4", "gpt2_train_mp8", "gpt2_train_dp2xmp4"}
CASES = [pytest.param(c.name, marks=pytest.mark.slow) if c.name in SLOW else c.name for c in zoo.cases()]


def _graph(name: str, marked: bool):
    """The case traced as the harness traces it: marked for propagation, unmarked for auto."""
    case = next(c for c in zoo.cases() if c.name == name)
    zoo.annotate.mode = "shardprop" if marked else "plain"
    try:
        pf = sp.parallelize(lambda *a: case.fn(*a), mesh=case.mesh)
        graph, _ = pf._trace(case.args(), {})
    finally:
        zoo.annotate.mode = "shardprop"
    return BindUserStrategies()(graph)


def _evaluated(graph, ops: dict, inputs: dict, shared_copies: bool = False, decisions=None) -> float:
    """The plan priced afresh: a new context, new prices, new compute times (rules built anew)."""
    ctx = PlanContext(graph, RuleBook())
    compute = ComputeTimes(DEFAULT_COST, graph.mesh, resident_values(graph))
    e = evaluate_plan(ctx, ops, inputs, Prices(DEFAULT_COST, True), compute, shared_copies=shared_copies,
                      decisions=decisions)
    return e["compute"] + e["communication"]


def _written(graph) -> tuple:
    return {op: op.strategy for op in graph.ops}, {i: v.layout for i, v in enumerate(graph.inputs)}


@pytest.mark.parametrize("name", CASES)
def test_propagation_figure_is_the_evaluators(name):
    graph = _graph(name, marked=True)
    prop = PropagateSharding()
    prop(graph)
    claimed = prop.modeled[graph]
    assert claimed > 0
    assert _evaluated(graph, *_written(graph), shared_copies=True) == pytest.approx(claimed, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("name", CASES)
def test_search_objective_refinement_and_plan_cost_are_the_evaluators(name):
    search = SearchStrategies()
    graph = _graph(name, marked=False)
    problem, sol, _ = search.search(graph)
    # the solver's objective is the solved plan priced op by op (a copy once per layout per
    # reading decision: the decisions are the problem's)
    decisions = problem.decisions
    solved = problem.op_strategies(sol.choice)
    assert _evaluated(graph, *solved, decisions=decisions) == pytest.approx(sol.objective, rel=1e-9, abs=1e-15)
    # refinement's own account of what its moves saved
    assert _evaluated(graph, *sol.plan, decisions=decisions) == pytest.approx(sol.claimed, rel=1e-9, abs=1e-15)
    assert sol.claimed <= sol.objective * (1 + 1e-12)
    # what plan.cost reports is the written plan, priced afresh (the same trace, op for op)
    again = search(_graph(name, marked=False))
    decisions = {new: decisions[old] for old, new in zip(graph.ops, again.ops, strict=True)}
    assert again.auto.solver["loop_bodies"] == 0.0   # (no loops in the zoo: the objective is the whole step)
    assert again.auto.step_time == pytest.approx(again.auto.solver["claimed"], rel=1e-9, abs=1e-15)
    assert _evaluated(again, *_written(again), decisions=decisions) == pytest.approx(again.auto.step_time, rel=1e-9,
                                                                                     abs=1e-15)


def test_marks_kept_by_auto_report_user():
    def net(x, w1, w2):
        h = sp.shard(jnp.matmul, ((2, 4), (4, 1)))(x, w1)
        return jnp.matmul(jnp.tanh(h), w2)
    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((16, 32), (32, 16), (16, 16)))
    for mode in ("auto", "sharding_propagation"):
        plan = sp.parallelize(net, mesh=8, mode=mode).plan(x, w1, w2)
        matmuls = [o for o in plan.ops if o.primitive == "dot_general"]
        assert matmuls[0].in_strategy == ((2, 4), (4, 1)) and matmuls[0].origin == "user", mode
        assert matmuls[1].origin != "user", mode
        if mode == "auto":
            assert matmuls[1].origin == "auto (searched)"


def test_rules_are_interned_once_per_equal_op():
    graph = _graph("gpt2_train_mp8", marked=True)
    book = RuleBook()
    a, b = PlanContext(graph, book), PlanContext(graph, book)
    assert all(a.rules[op] is b.rules[op] for op in graph.ops)
    assert len({id(r) for r in a.rules.values()}) == len(set(a.rules.values()))   # equal rules: one object
    assert a.signatures == b.signatures


def test_one_price_of_a_move():
    """A move's price is the planner's, with a terminal value's step-end discount; a
    move that would make a partial, or a layout that does not fit, is impossible;
    slicing is free."""
    from shardprop.passes.cost import IMPOSSIBLE
    graph = _graph("gpt2_train_mp8", marked=True)
    ctx = PlanContext(graph, RuleBook())
    step_end = StepEnd(graph)
    mesh = Mesh(("a", "b"), (2, 4))
    prices = Prices(DEFAULT_COST, True)
    terminal = next(v for v in graph.inputs if v in step_end.terminal and v.type.rank == 2)
    other = next(v for op in graph.ops for v in op.outputs if v not in step_end.terminal and v.type.rank == 2
                 and all(s % 8 == 0 for s in v.type.shape))
    for v in (terminal, other):
        src, dst = Layout((("a", "b"), ())), Layout(((), ("a", "b")))
        cost = ctx.step_end.cost_for(DEFAULT_COST, v)
        assert prices.move(v, src, dst, mesh, step_end) == redistribution_cost(v.type.shape, v.type.itemsize, src, dst,
                                                                               mesh, True, cost)
        partial = Layout(((), ()), ("a",))
        assert prices.move(v, partial.without_partial(), partial, mesh, step_end) == IMPOSSIBLE
        assert prices.move(v, Layout(((), ())), src, mesh, step_end) == 0.0
        layout, seconds = prices.completion(v, partial, mesh, step_end)
        assert not layout.partial and seconds == prices.move(v, partial, layout, mesh, step_end)


def test_best_move_takes_the_first_cheapest_that_beats_the_current():
    prices = {"a": 3.0, "b": 1.0, "c": 1.0, "d": 0.5}
    assert best_move("abc", lambda m, bound: prices[m], 2.0) == ("b", 1.0)          # first of equals
    assert best_move("abcd", lambda m, bound: prices[m], 2.0, admit=lambda m, p: m != "d") == ("b", 1.0)
    assert best_move("a", lambda m, bound: prices[m], 2.0) is None
    assert best_move("b", lambda m, bound: prices[m], 1.0 + 1e-16, better=lambda x, y: x < y - 1e-15) is None
