"""The search's shortcuts under a memory limit keep its promises: LP diving stops at a
plan it cannot beat by more than ``DIVE_STOP`` and returns the cheapest plan that fits
it met; an arrangement that runs out of time leaves the others' plans standing, and one whose
LP bound cannot beat a plan found is not searched."""
import sys
from pathlib import Path

import pytest

from shardprop.ir.errors import ShardingError
from shardprop.ir.mesh import Mesh

sys.path.insert(0, str(Path(__file__).parent))
from test_auto import row_lp  # noqa: E402

LOOSE = 10**12   # bytes: a memory limit no plan comes near


def mlp_on_8(args, sizes=(2, 4), count_mesh=True):
    """tests/test_auto.py's SGD MLP step traced on a 2-D mesh of 8 devices; with
    ``count_mesh`` the mesh stands for ``mesh=8``, whose arrangements the search tries."""
    from test_auto import sgd_step, traced_graph
    g = traced_graph(sgd_step, args, Mesh(("d0", "d1"), sizes), tied=(0,))
    g.count_mesh = count_mesh
    return g


@pytest.mark.slow
def test_dive_stops_at_an_incumbent_it_cannot_beat():
    """Given a plan that fits at the LP's own bound, the dive solves nothing more and
    returns it (no plan below the bound exists)."""
    from shardprop.passes.auto.search import _dive
    problem, memory, red, model, rows, limit, lp, _ = row_lp()
    plan = {t: 0 for t in problem.unary}
    solves = model.solves
    out = _dive(lp, model, red, rows, limit, None, problem, fits=lambda c: c is plan, incumbent=(lp.bound, plan))
    assert out is plan and model.solves == solves


@pytest.mark.slow
def test_dive_returns_a_plan_that_fits_and_no_dearer_than_its_start():
    """With the modeled peak as its test, the dive returns a plan that fits the limit,
    no dearer than the incumbent it was given."""
    from shardprop.passes.auto.search import _dive
    problem, memory, red, model, rows, limit, lp, _ = row_lp()

    def fits(c):
        return memory.peak(c)[0] <= limit
    # (the leanest plan: each decision at the candidate holding the fewest bytes in the row)
    lean = {t: int(vec.argmin()) for t, vec in rows[0].nodes.items()}
    lean = lp.complete({**lp.choice, **lean})
    start = (problem.objective(lean), lean) if fits(lean) else None
    out = _dive(lp, model, red, rows, limit, None, problem, fits=fits, incumbent=start)
    assert out is not None and fits(out)
    assert problem.objective(out) >= lp.bound * (1 - 1e-9)
    if start is not None:
        assert problem.objective(out) <= start[0] * (1 + 1e-12)


def test_an_arrangement_out_of_time_leaves_the_others_plan():
    """On a device-count mesh, an arrangement whose search runs out of time before any
    plan does not discard the plan another arrangement found (it raised, and the whole
    search with it); the status names the arrangement left out."""
    import jax.numpy as jnp
    import shardprop as sp
    from shardprop.passes.auto import search as S

    class OutOfTime(S.SearchStrategies):
        def search(self, graph, *a, **k):
            if graph.mesh.axis_sizes[0] == 4:
                raise ShardingError("the strategy search found no plan within its time limit (simulated)")
            return super().search(graph, *a, **k)

    def f(x, w):
        return jnp.tanh(x @ w)
    args = (jnp.ones((64, 32)), jnp.ones((32, 32)))
    g = sp.parallelize(f, mesh=8, mode="auto")._trace(args, {})[0]
    from shardprop.compiler.pipeline import Options, run_pipeline
    from shardprop.passes.bind_strategies import BindUserStrategies
    g = run_pipeline(g, Options(mode="auto"), passes=[BindUserStrategies()]).graph
    out = OutOfTime()(g)
    assert str(out.mesh).startswith("d0=2") and "left out, out of time" in out.auto.solver["status"]
    assert "d0=4" in out.auto.solver["status"]

    class AllOutOfTime(S.SearchStrategies):
        def search(self, graph, *a, **k):
            raise ShardingError("the strategy search found no plan within its time limit (simulated)")
    with pytest.raises(ShardingError, match="simulated"):
        AllOutOfTime()(run_pipeline(sp.parallelize(f, mesh=8, mode="auto")._trace(args, {})[0], Options(mode="auto"),
                                    passes=[BindUserStrategies()]).graph)


@pytest.mark.slow
def test_dive_stops_once_its_incumbent_is_proven_within_the_search_gap():
    """From an incumbent the root LP's bound proves within the search's gap (``enough``)
    the dive goes on for at most ``polish`` seconds (none: it is returned at once), though
    the dive's own tolerance (DIVE_STOP) is not met: the LP rounds keep such a plan, and
    diving on from one cost 11 s on the 2-layer GPT step."""
    from shardprop.passes.auto.search import DIVE_STOP, RELAXED_GAP, _dive
    problem, memory, red, model, rows, limit, lp, _ = row_lp()
    plan = {t: 0 for t in problem.unary}
    near = lp.bound * (1 + 4 * DIVE_STOP)
    solves = model.solves
    out = _dive(lp, model, red, rows, limit, None, problem, fits=lambda c: c is plan, incumbent=(near, plan),
                enough=lp.bound / (1 - RELAXED_GAP))
    assert out is plan and model.solves == solves
    # (given time to polish, or without it, the dive solves on)
    _dive(lp, model, red, rows, limit, None, problem, fits=lambda c: c is plan, incumbent=(near, plan),
          enough=lp.bound / (1 - RELAXED_GAP), polish=60.0)
    assert model.solves > solves
    solves = model.solves
    _dive(lp, model, red, rows, limit, None, problem, fits=lambda c: c is plan, incumbent=(near, plan))
    assert model.solves > solves


@pytest.mark.slow
def test_no_dive_where_no_rounding_fits_and_they_overflow_without_a_row(monkeypatch):
    """Where no rounding of the rows' LP fits and they peak at a point the LP has no row
    for, that row is added and the LP solved again before any dive: a dive on the LP
    without it ends at plans that overflow there too (on the 2-layer GPT step on 4 x 2
    at 0.7 it spent 9.5 s to end at one)."""
    from shardprop.passes.auto import search as S
    problem, memory, red, model, rows, limit, lp, at = row_lp()
    other = next(p for p in range(1, len(problem.graph.ops) + 1) if p != at)

    class Overflowing:   # (every plan peaks over the limit at a point without a row)
        def peak(self, choice):
            return 2 * limit, other

        def row(self, point):
            return memory.row(point)
    dives = []
    monkeypatch.setattr(S, "_dive", lambda *a, **k: dives.append(1))
    rows, points = list(rows), {at}
    search = S.SearchStrategies(memory_limit=int(limit))
    search._bound, search._deadline = 0.0, None   # (what _solve_under_limit sets)
    plan, what, _ = search._relaxed_round(red, problem, Overflowing(), rows, points, limit, None, model)
    assert plan is None and what == "more" and not dives
    assert other in points and rows[-1].point == other


def test_brief_multipliers_keep_their_time_limit_where_no_plan_fits():
    """The multipliers given a brief time limit stop at it where no plan fits yet (they
    ran all 30 priced solves, 20 s on the 2-layer GPT step on 2 x 4 at 0.5, given 1 s)."""
    from shardprop.passes.auto import lagrange, milp
    from shardprop.passes.auto.problem import Problem
    from shardprop.passes.auto.search import _Liveness
    from shardprop.passes.cost import DEFAULT_COST
    from test_auto import problem_data, sgd_step, traced_graph
    params, x, y = problem_data(256, 64, 2)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("dp", "mp"), (2, 4)), tied=(0,))
    problem = Problem(g, DEFAULT_COST)
    memory = _Liveness(g, problem)
    red = milp.reduce(problem, memory_matters=True)
    out = lagrange.search(red, problem.objective, memory.peak, memory.row, limit=1.0, time_limit=1e-6)
    assert out.choice is None and out.iterations == 1


@pytest.mark.slow
def test_first_lp_rounds_do_not_dive_from_a_far_rounding_that_fits(monkeypatch):
    """A rounding that fits outside ``relaxed_gap`` is not dived from on the first LP
    rounds (``dive_far=False``): the multipliers go first, and may prove it (on the
    2-layer GPT step on 2 x 4 at 0.5 the dive from one spent 9 s and found none cheaper);
    the later rounds (``dive_far=True``) dive from it."""
    from shardprop.passes.auto import search as S
    problem, memory, red, model, rows, limit, lp, at = row_lp()
    dives = []
    monkeypatch.setattr(S, "_dive", lambda *a, **k: dives.append(1))
    search = S.SearchStrategies(memory_limit=int(limit), relaxed_gap=0.05)
    search._bound, search._deadline = 0.0, None
    plan, what, _ = search._relaxed_round(red, problem, memory, list(rows), {at}, limit, None, model, dive_far=False)
    assert plan is not None and plan[0] > lp.bound / (1 - 0.05)   # (a rounding that fits, outside the gap)
    assert what == "exact" and not dives
    search._relaxed_round(red, problem, memory, list(rows), {at}, limit, None, model, dive_far=True)
    assert dives


@pytest.mark.slow
def test_warm_lp_logs_each_solve():
    """``WarmLP.log`` (what ``bench/search_time.py --lp-log`` prints) has one entry per
    solve: its seconds, the simplex's iterations, the memory rows held and the status."""
    problem, memory, red, model, rows, limit, lp, _ = row_lp()
    assert len(model.log) == model.solves == 2
    (w0, c0, it0, n0, st0), (w1, c1, it1, n1, st1) = model.log
    assert (n0, st0) == (0, "Optimal") and (n1, st1) == (1, "Optimal")
    assert it0 > 0 and it1 > 0 and min(w0, c0, w1, c1) >= 0
    model.solve(red.kept, rows, 1.0)   # (a limit no plan meets: the row alone is infeasible)
    assert len(model.log) == 3 and model.log[-1][3] == 1 and model.log[-1][4] != "Optimal"


def test_an_arrangement_whose_bound_cannot_beat_the_plan_found_is_not_searched():
    """On a device-count mesh the arrangements are searched least LP bound first, and one
    whose bound (its LP without memory rows: below every plan it has) is no cheaper than a
    plan found already is not searched at all; the status says so. The plan is the
    cheapest of the arrangements each searched alone, and the one left out has none under
    its bound. (With the cpu profile, which prices a group by the ranks it spans, 4 x 2
    is the cheaper here, and comes second in the arrangements' own order.)"""
    from shardprop.passes.auto import search as S
    from shardprop.passes.cost import CostModel
    from test_auto import problem_data
    cpu = CostModel.builtin("cpu")
    args = problem_data(64, 1024, 3)
    searched, bounds = [], {}

    class Recording(S.SearchStrategies):
        def search(self, graph, *a, **k):
            searched.append(graph.mesh.axis_sizes)
            return super().search(graph, *a, **k)

        def _by_bound(self, graph, meshes, prices):
            out = super()._by_bound(graph, meshes, prices)
            bounds.update((m.axis_sizes, b) for m, _, b in out)
            return out

    g = mlp_on_8(args)
    # (exact_ops=0: no un-coarsened search, whose plans the bound does not bound; a limit that
    # does not bind: without one the arrangements get no bounds, each search being that LP)
    out = Recording(cpu, memory_limit=LOOSE, exact_ops=0)(g)
    status = out.auto.solver["status"]
    assert searched == [(4, 2)] and out.mesh.axis_sizes == (4, 2)
    assert "arrangements not searched, bound above the plan: d0=2 d1=4" in status, status
    alone = {}
    for sizes in ((2, 4), (4, 2)):
        one = mlp_on_8(args, sizes, count_mesh=False)
        alone[sizes] = S.SearchStrategies(cpu, memory_limit=LOOSE, exact_ops=0)(one).auto
    assert alone[(4, 2)].step_time < alone[(2, 4)].step_time
    assert out.auto.step_time == pytest.approx(alone[(4, 2)].step_time, rel=1e-9)
    assert bounds[(4, 2)] <= alone[(4, 2)].solver["objective"] * (1 + 1e-9)
    assert out.auto.solver["objective"] <= bounds[(2, 4)] <= alone[(2, 4)].solver["objective"] * (1 + 1e-9)
    # measure=True (compare_hands) times hand plans the model may misrank: every arrangement's
    searched.clear()
    again = mlp_on_8(args)
    Recording(cpu, memory_limit=LOOSE, exact_ops=0, compare_hands=True)(again)
    assert searched == [(4, 2), (2, 4)]


def test_the_searches_of_one_compile_solve_an_arrangements_bound_once(monkeypatch):
    """The memory check's searches again build the same arrangements: their LP bounds are
    kept within the compile (``memo.LP_BOUNDS``), solved once each."""
    from shardprop.passes.auto import memo, milp
    from shardprop.passes.auto import search as S
    from shardprop.passes.cost import CostModel
    from test_auto import problem_data
    solves = []
    real = milp.solve
    monkeypatch.setattr(milp, "solve", lambda *a, **k: (solves.append(k.get("relax")), real(*a, **k))[1])
    g = mlp_on_8(problem_data(64, 1024, 3))
    with memo.one_compile():
        for _ in range(2):
            S.SearchStrategies(CostModel.builtin("cpu"), memory_limit=LOOSE, exact_ops=0)(g)
        assert len(memo.LP_BOUNDS) == 2
    assert solves.count(True) == 2 and memo.LP_BOUNDS == {}


@pytest.mark.slow
@pytest.mark.parametrize("cold_seconds, tried", [(0.0, True), (10.0, False)])
def test_brief_exact_rows_only_where_the_cold_lp_leaves_branch_and_bound_room(monkeypatch, cold_seconds, tried):
    """Where the rounds end with a plan outside the gap, the exact rows get ``brief``
    seconds, but only where the warm model's cold LP took under ``EXACT_ROOT_SHARE`` of
    them: branch and bound starts from such a solve (on the GPT steps on 4 x 2 at half the
    free peak they ran their 3 s out with no plan every time). Else the status says why
    they were not tried."""
    from shardprop.passes.auto import milp
    from shardprop.passes.auto import search as S
    problem, memory, red, model, rows, limit, lp, at = row_lp()
    monkeypatch.setattr(model, "cold_seconds", lambda: cold_seconds)
    exact = []
    real = milp.solve
    monkeypatch.setattr(milp, "solve", lambda red, *a, **k: (exact.append(bool(a and a[0])), real(red, *a, **k))[1])
    search = S.SearchStrategies(memory_limit=int(limit), relaxed_gap=1e-9)   # (every plan is outside the gap)
    search._bound, search._deadline = 0.0, None
    sol, _ = search._solve_under_limit(red, problem, memory, limit, (float("inf"), None), seed=[at], warm=model,
                                       brief=3.0)
    assert sol is not None and memory.peak(sol.choice)[0] <= limit
    assert any(exact) == tried
    assert ("the exact rows not tried" in sol.status) == (not tried), sol.status


@pytest.mark.slow
def test_a_search_stops_once_its_bound_reaches_the_plan_another_arrangement_found(monkeypatch):
    """Given ``beat`` (the objective of another arrangement's plan), the memory rounds stop
    once the bound they prove reaches it: no plan here can beat that one. Without it the
    same search goes on to the multipliers and the exact rows (on the 2-layer GPT step on
    8 devices at 0.5, 2 x 4's rounds passed 4 x 2's plan 2.4 s before its search ended)."""
    from shardprop.passes.auto import lagrange, milp
    from shardprop.passes.auto import search as S
    problem, memory, red, model, rows, limit, lp, at = row_lp()
    monkeypatch.setattr(model, "cold_seconds", lambda: 0.0)   # (the exact rows are tried)
    calls = []
    real_lagrange, real_solve = lagrange.search, milp.solve
    monkeypatch.setattr(lagrange, "search", lambda *a, **k: (calls.append("multipliers"), real_lagrange(*a, **k))[1])
    monkeypatch.setattr(milp, "solve", lambda red, *a, **k: (calls.append("exact rows") if a and a[0] else None,
                                                             real_solve(red, *a, **k))[1])

    def run(beat):
        calls.clear()
        search = S.SearchStrategies(memory_limit=int(limit), relaxed_gap=1e-9)   # (every plan outside the gap)
        search._bound, search._deadline = 0.0, None
        sol, _ = search._solve_under_limit(red, problem, memory, limit, (float("inf"), None), seed=[at], warm=model,
                                           brief=3.0, beat=beat)
        return sol, search._bound, list(calls)
    sol, bound, parts = run(None)
    assert "multipliers" in parts and "exact rows" in parts and "stopped:" not in sol.status
    sol, bound, parts = run(lp.bound * 0.5)   # (a plan the first LP round's bound already passes)
    assert parts == [] and bound >= lp.bound * 0.5
    assert sol is None or "stopped: the bound" in sol.status


def test_without_a_limit_the_arrangements_get_no_bounds(monkeypatch):
    """Without a memory limit each arrangement's search is its LP (and the MILP where that
    is fractional): a bound would be the same LP solved twice (the 2-layer GPT step on 8
    devices searched 3.3 s with bounds, 2.9 s without), so none is solved."""
    from shardprop.passes.auto import milp
    from shardprop.passes.auto import search as S
    from shardprop.passes.cost import CostModel
    from test_auto import problem_data
    relaxed = []
    real = milp.solve
    monkeypatch.setattr(milp, "solve", lambda *a, **k: (relaxed.append(k.get("relax")), real(*a, **k))[1])
    g = mlp_on_8(problem_data(64, 1024, 3))
    out = S.SearchStrategies(CostModel.builtin("cpu"), exact_ops=0)(g)
    assert True not in relaxed and "not searched" not in out.auto.solver["status"]
