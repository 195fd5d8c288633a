"""mode="auto" under a memory limit (issue 27): candidates in both axis orders,
the FSDP layout ("stored split, gathered at use") as a candidate of every weight,
and the hand plans the search starts from."""
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import shardprop as sp
from shardprop.ir.mesh import Mesh
from shardprop.passes.auto import hand, memo
from shardprop.passes.auto.candidates import factor_assignments, tensor_layouts
from shardprop.passes.plan_core.context import PlanContext, RuleBook

sys.path.insert(0, str(Path(__file__).parent))
from test_auto import assert_close, problem_data, row_lp, sgd_step, traced_graph  # noqa: E402


def matmul_rule(mesh):
    g = traced_graph(lambda a, b: a @ b, (np.zeros((64, 32), np.float32), np.zeros((32, 16), np.float32)), mesh)
    op = next(op for op in g.ops if op.kind == "dot_general")
    return PlanContext(g, RuleBook()).rule(op)


def test_candidates_take_a_factors_axes_in_both_orders():
    mesh = Mesh(("a", "b"), (2, 4))
    cands = factor_assignments(matmul_rule(mesh), mesh)
    assert any(("a", "b") in c for c in cands) and any(("b", "a") in c for c in cands)
    assert len(set(cands)) == len(cands)
    assert cands[0] == ((), (), ())                      # replicated first
    layouts = {lay.dims for lay in tensor_layouts((64, 32), mesh)}
    assert (("a", "b"), ()) in layouts and (("b", "a"), ()) in layouts
    assert ((), ("b", "a")) in layouts


def test_fixed_axes_keep_their_order():
    mesh = Mesh(("a", "b", "c"), (2, 2, 2))
    rule = matmul_rule(mesh)
    cands = factor_assignments(rule, mesh, [("b", "a"), None, None])
    assert cands and all(c[0] == ("b", "a") for c in cands)


@pytest.mark.slow
def test_a_plan_in_the_other_axis_order_equals_one_device():
    """The 2048 x 512 SGD step on 2 x 4 takes ('b', 'a') splits for its loss."""
    params, x, y = problem_data(2048, 512, 2)
    f = sp.parallelize(sgd_step, mesh=((2, 4), ("a", "b")), mode="auto")
    assert_close(f(params, x, y), sgd_step(params, x, y), 1e-4)
    plan = f.plan(params, x, y)
    reversed_ = [op for op in plan.graph.ops if getattr(op, "strategy", None) is not None
                 and any(axes == ("b", "a") for axes in op.strategy.factors)]
    assert reversed_


# -- the hand plans the search starts from --------------------------------------------------

def adam_case(batch=64, width=256, layers=2):
    import optax
    from test_auto import adam_step
    params, x, y = problem_data(batch, width, layers)
    return adam_step, (params, optax.adam(1e-3).init(params), x, y)


def limited_plan(fn, args, mesh, frac, **kw):
    free = sp.parallelize(fn, mesh=mesh, mode="auto", progress=False, **kw).plan(*args)
    limit = int(frac * free.cost.peak_memory)
    return sp.parallelize(fn, mesh=mesh, mode="auto", memory_limit=limit, progress=False, **kw).plan(*args), limit


def assert_no_hand_plan_beats_auto(plan, limit):
    hands = plan.cost.hand_plans
    assert hands, "no hand plan was compared"
    fitting = [h for h in hands if h.fits and h.time is not None]
    for h in fitting:   # (as written: a copy several ops read made once, as the program makes it)
        assert h.peak <= limit
        assert plan.cost.written_time <= h.written * (1 + 1e-9), (h, plan.cost.written_time)
    assert plan.cost.peak_memory <= limit


@pytest.mark.slow
@pytest.mark.parametrize("frac", [0.5, 0.7, 0.9])
def test_hand_plans_are_compared_and_never_beat_auto_on_an_adam_step(frac):
    fn, args = adam_case()
    plan, limit = limited_plan(fn, args, ((2, 4), ("dp", "mp")), frac, donate_argnums=(0, 1))
    assert_no_hand_plan_beats_auto(plan, limit)
    names = {h.name.split(" = ")[0] for h in plan.cost.hand_plans}
    assert {"DP", "ZeRO-1", "FSDP", "Megatron"} <= names
    text = plan.explain()
    assert "hand plans compared with" in text and "FSDP" in text and "ZeRO-1" in text


@pytest.mark.parametrize("case", ["megatron_mlp", "megatron_attention"])
@pytest.mark.parametrize("frac", [0.5, 0.7, 0.9])
def test_zoo_transformer_blocks_never_worse_than_their_hand_plans(case, frac):
    sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
    import zoo
    c = next(c for c in zoo.cases() if c.name == case)
    zoo.annotate.mode, zoo.annotate.mesh = "plain", c.mesh
    plan, limit = limited_plan(c.fn, c.args(), c.mesh, frac)
    assert_no_hand_plan_beats_auto(plan, limit)


@pytest.mark.slow
# (0.6 of the free plan's modeled peak is 4.2 MiB, what 0.5 was before the model left Adam's and the
# GELU's fused intermediates out of the free plan's peak)
@pytest.mark.parametrize("frac", [0.6, 0.9])
def test_zoo_gpt_step_never_worse_than_its_hand_plans(frac):
    sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    import zoo
    c = next(c for c in zoo.cases() if c.name == "gpt2_train_dp2xmp4")
    zoo.annotate.mode, zoo.annotate.mesh = "plain", c.mesh
    # (the `cpu` profile, as bench/compare.py plans it: the default model propagates the marks
    # to another plan)
    plan, limit = limited_plan(c.fn, c.args(), c.mesh, frac, donate_argnums=c.state_argnums, cost_model="cpu")
    assert_no_hand_plan_beats_auto(plan, limit)
    # the case's Megatron marks, priced on auto's own problem (bench/auto_marks.py): where they
    # fit the modeled limit they are a plan of the search's problem, so auto's plan as written is
    # at most their objective (a copy per reader) over one less the search's proven gap
    from bench import zoo as bench_zoo   # (the module whose annotate bench/auto_marks.py sets)
    from bench.auto_marks import marks_on_the_problem, marks_plan, unmarked_problem
    bc = next(x for x in bench_zoo.cases() if x.name == c.name)
    marks = marks_on_the_problem(unmarked_problem(bc, bc.mesh, "cpu", bc.args())[1],
                                 marks_plan(bc, bc.mesh, "cpu", bc.args()))
    assert marks["same_ops"] and not marks["missing"]
    assert marks["written"] <= marks["per_reader"] * (1 + 1e-12)
    fits = marks["peak"] <= (plan.cost.modeled_limit or limit)
    assert fits or frac < 0.9, (marks["peak"], plan.cost.modeled_limit, limit)   # (at 0.9 they fit: it runs)
    if fits:
        gap = plan.cost.solver.get("gap", 0.0)
        assert plan.cost.written_time <= marks["per_reader"] / (1 - gap) * (1 + 1e-9), (plan.cost.written_time, marks)


def test_out_of_budget_the_search_returns_the_best_hand_plan_with_its_gap():
    from shardprop.passes.auto import SearchStrategies
    fn, args = adam_case()
    g = traced_graph(fn, args, Mesh(("dp", "mp"), (2, 4)), tied=(0, 1))
    _, free, free_peak = SearchStrategies().search(g)
    s = SearchStrategies(memory_limit=int(0.7 * free_peak), time_budget=0.0)
    s._deadline = 0.0   # (spent before the rounds start)
    problem, sol, peak = s.search(g)
    assert sol is not None and "the hand plan" in sol.status and "time budget" in sol.status
    assert peak <= 0.7 * free_peak
    assert 0 <= sol.gap < 1 and sol.bound <= sol.modeled * (1 + 1e-9)


def test_one_compile_shares_one_search_budget(monkeypatch):
    """The memory check's searches again (a compiled peak over the limit) take what is left
    of the compile's budget, not a fresh one each: spent before the first round, every
    round returns the best hand plan that fits, with its gap."""
    import shardprop.compiler.api as api
    fn, args = adam_case()
    mesh = ((2, 4), ("dp", "mp"))
    free = sp.parallelize(fn, mesh=mesh, mode="auto", progress=False).plan(*args)
    monkeypatch.setattr(api, "SEARCH_TIME_BUDGET", 0.0)
    limit = int(0.7 * free.cost.peak_memory)
    plan = sp.parallelize(fn, mesh=mesh, mode="auto", memory_limit=limit, progress=False).plan(*args)
    status = plan.cost.solver["status"]
    assert "the hand plan" in status and "time budget" in status, status
    assert plan.cost.peak_memory <= limit


# -- the memory rows' LP, rounded ----------------------------------------------------------

@pytest.mark.slow
def test_rounded_lp_plan_fits_and_is_within_its_proven_gap_of_the_exact_rows():
    """Under a limit the rows' LP relaxation is solved first and rounded: the plan it
    keeps fits, its bound is at most the exact rows' optimum, and the plan is within
    RELAXED_GAP of that optimum."""
    from shardprop.passes.auto import SearchStrategies
    from shardprop.passes.auto.search import RELAXED_GAP
    fn, args = adam_case()
    g = traced_graph(fn, args, Mesh(("dp", "mp"), (2, 4)), tied=(0, 1))
    _, free, free_peak = SearchStrategies().search(g)
    for frac in (0.5, 0.7):
        limit = int(frac * free_peak)
        how = dict(follow=False, share_layers=False, refine=False, hands=False)   # (one problem, solved as is)
        _, exact, _ = SearchStrategies(memory_limit=limit, relaxed_gap=None).search(g, **how)
        _, rounded, peak = SearchStrategies(memory_limit=limit).search(g, **how)
        assert peak <= limit and rounded.choice
        assert rounded.bound <= exact.objective * (1 + 1e-9)
        assert rounded.objective <= exact.objective * (1 + RELAXED_GAP) * (1 + 1e-9), (rounded.status, exact.status)


@pytest.mark.slow
def test_a_rounded_lp_that_fits_no_plan_leaves_the_decision_to_the_exact_rows(monkeypatch):
    """Where no rounding of the rows' LP fits (simulated: none is offered), the exact
    rows decide, and their plan fits."""
    from shardprop.passes.auto import SearchStrategies, search
    monkeypatch.setattr(search, "_roundings", lambda *a, **k: [])
    params, x, y = problem_data(512, 256, 2)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("a", "b"), (2, 4)), tied=(0,))
    _, free, free_peak = SearchStrategies().search(g)
    _, sol, peak = SearchStrategies(memory_limit=int(0.6 * free_peak)).search(g)
    assert sol is not None and peak <= 0.6 * free_peak and "LP relaxation" not in sol.status


@pytest.mark.slow
def test_under_a_limit_the_cheapest_plan_any_part_met_is_kept(monkeypatch):
    """A rounded LP plan outside RELAXED_GAP, and the exact rows out of time before any
    plan (simulated): the multipliers' plan is returned where it is cheaper (here the
    exact rows' own optimum, found first), with the best bound any part proved; where
    they find none, the rounded plan stands. Either way every plan offered is at least
    the one returned."""
    from shardprop.passes.auto import SearchStrategies, lagrange, milp, search
    params, x, y = problem_data(512, 256, 2)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("a", "b"), (2, 4)), tied=(0,))
    _, free, free_peak = SearchStrategies().search(g)
    limit = int(0.6 * free_peak)
    _, best, _ = SearchStrategies(memory_limit=limit, exact_ops=0).search(g)
    solve = milp.solve

    def out_of_time(red, memory_rows=(), *a, **k):
        if memory_rows and not k.get("relax"):
            raise sp.ShardingError("the strategy search found no plan within its time limit of 1 s")
        return solve(red, memory_rows, *a, **k)
    monkeypatch.setattr(milp, "solve", out_of_time)
    offered = []
    offer = search._Best.offer
    monkeypatch.setattr(search._Best, "offer", lambda self, c, part, how: offered.append(
        self.problem.objective(c)) or offer(self, c, part, how))
    for found in (best.choice, None):
        monkeypatch.setattr(lagrange, "search", lambda red, objective, *a, rows=(), **k: lagrange.Outcome(
            found, objective(found) if found else float("inf"), 0.0, list(rows), 1, 0.0))
        offered.clear()
        _, sol, peak = SearchStrategies(memory_limit=limit, exact_ops=0).search(g)
        rounded = [t for t in offered if found is None or t > best.objective * (1 + 1e-9)]
        assert peak <= limit and rounded and min(rounded) > best.objective * (1 + 1e-9)   # (the LP's plan: dearer)
        assert sol.objective == pytest.approx(min(offered), rel=1e-12)
        assert sol.status.startswith("Lagrange multipliers") == (found is not None), sol.status
        assert sol.bound <= best.objective * (1 + 1e-9) and sol.gap == pytest.approx(1 - sol.bound / sol.objective)


def test_a_compile_shares_warm_models_and_hand_solves_among_its_searches_and_leaves_none(monkeypatch):
    """A plan must not depend on what the process compiled before: what a compile's
    searches keep for each other (``memo.py``) is dropped when it starts and ends."""
    remembered = []
    real = memo.remember
    monkeypatch.setattr(memo, "remember", lambda store, key, value, most: (remembered.append(key),
                                                                           real(store, key, value, most)))
    memo.HAND_SOLVES[("left", "by an earlier search")] = {}
    seen_at_start = []
    real_families = hand.families
    monkeypatch.setattr(hand, "families", lambda problem: (seen_at_start.append(
        ("left", "by an earlier search") in memo.HAND_SOLVES), real_families(problem))[1])
    params, x, y = problem_data(256, 128, 2)
    plan, limit = limited_plan(sgd_step, (params, x, y), ((2, 4), ("dp", "mp")), 0.7)
    assert plan.cost.peak_memory <= limit
    assert remembered, "the compile's searches kept nothing for each other"
    assert seen_at_start and not any(seen_at_start), "a search saw what came before its compile"
    assert memo.WARM_MODELS == {} and memo.HAND_SOLVES == {} and memo.LP_BOUNDS == {}


@pytest.mark.slow
def test_hand_plans_solved_once_per_problem_and_priced_again():
    """The searches one compile runs again (memory_check) build the same problem: the
    hand plans' solves are reused, each plan priced again, the same figures."""
    from shardprop.passes.auto import SearchStrategies, hand
    fn, args = adam_case()
    g = traced_graph(fn, args, Mesh(("dp", "mp"), (2, 4)), tied=(0, 1))
    _, free, free_peak = SearchStrategies().search(g)
    memo.forget()   # (other tests may have solved this problem's hand plans)
    first, again = (SearchStrategies(memory_limit=int(0.7 * free_peak)) for _ in range(2))
    first.search(g)
    again.search(g)
    solved = [h for h in first._hands if h.choice is not None]
    assert solved and all("reused" not in h.note for h in solved)
    reused = {(h.name, h.axes): h for h in again._hands if h.choice is not None}
    for h in solved:
        r = reused[(h.name, h.axes)]
        assert "reused" in r.note and r.choice == h.choice
        assert r.time == pytest.approx(h.time, rel=1e-12) and r.peak == h.peak


def _adam_hands(batch: int, width: int, shape: tuple):
    """(problem, liveness, hand families) of the Adam step on ``shape`` ("dp", "mp"),
    priced by the cpu profile."""
    from shardprop.passes.auto import hand
    from shardprop.passes.auto.problem import Problem
    from shardprop.passes.auto.search import _Liveness
    from shardprop.passes.cost import CostModel
    fn, args = adam_case(batch=batch, width=width)
    g = traced_graph(fn, args, Mesh(("dp", "mp"), shape), tied=(0, 1))
    problem = Problem(g, CostModel.builtin("cpu"))
    return problem, _Liveness(g, problem), hand.families(problem)


def _hand_plans_counting_milps(monkeypatch, problem, memory, fams):
    """A function of ``hand_plans``'s keywords giving (the hand plans by label, how many
    MILPs they ran); each call cold (a fresh warm LP, no solves kept). ``dive=True``: the
    fractional families dived on that warm LP as the search dives them."""
    from shardprop.passes.auto import SearchStrategies, hand, milp, warm_lp
    real = milp.solve

    def plans(dive: bool = False, **kw):
        memo.forget()
        model = warm_lp.WarmLP(milp.reduce(problem, memory_matters=True,
                                           also=[f.allowed for f in fams if f.allowed is not None]))
        calls = []
        monkeypatch.setattr(milp, "solve", lambda *a, **k: calls.append(1) or real(*a, **k))
        if dive:
            kw["dive"] = lambda allowed, lp, rounding: SearchStrategies()._dive_hand(problem, model, allowed, lp,
                                                                                   rounding)
        out = hand.hand_plans(problem, lambda c: memory.peak(c)[0], None, fams=fams, warm=model, **kw)
        return {h.label: h for h in out}, len(calls)
    return plans


def test_a_fractional_hand_family_that_cannot_be_the_best_keeps_its_lp_rounding(monkeypatch):
    """A family whose LP optimum is fractional goes to branch and bound only where its LP
    bound is under the best hand plan that fits; else it keeps the LP's rounding, priced.
    Solving it exactly (``every``, as a plan picked by name is) confirms the skip: its
    optimum is no cheaper than the best hand plan."""
    # (two families have a fractional LP, both dear)
    plans = _hand_plans_counting_milps(monkeypatch, *_adam_hands(batch=1024, width=128, shape=(2, 4)))
    quick, milps = plans(every=False)
    rounded = [h for h in quick.values() if "not solved exactly" in h.note]
    assert rounded and milps == 0
    least = min(h.time for h in quick.values() if h.time is not None and h not in rounded)
    exact, milps = plans(every=True)
    assert milps == len(rounded)
    for h in rounded:
        assert h.time >= least and h.fits and h.choice is not None
        e = exact[h.label]
        assert "not solved exactly" not in e.note and e.time <= h.time * (1 + 1e-9)
        assert e.time >= least * (1 - 1e-9)   # (what the LP bound promised)


def test_a_fractional_hand_family_within_the_margin_of_the_best_keeps_its_lp_rounding(monkeypatch):
    """A fractional family whose LP bound is under the best hand plan that fits, but by
    less than ``margin`` (the search's own tolerance), keeps its LP's rounding with no
    branch and bound; with no margin it gets branch and bound. Its exact optimum then
    confirms what the margin promised: no more than that fraction below the best."""
    # (Megatron over both axes: fractional, its LP bound 5.3% under the best hand plan)
    plans = _hand_plans_counting_milps(monkeypatch, *_adam_hands(batch=64, width=256, shape=(4, 2)))
    within, milps = plans(margin=0.10)
    rounded = [h for h in within.values() if "at most 10% below" in h.note]
    assert rounded and milps == 0
    least = min(h.time for h in within.values() if h.time is not None and h not in rounded)
    exact, milps = plans(margin=0.0)
    assert milps == len(rounded)
    for h in rounded:
        e = exact[h.label]
        assert "not solved exactly" not in e.note and e.time <= h.time * (1 + 1e-9)
        assert least * (1 - 0.10) <= e.time < least   # (under the best, by less than the margin)


def test_a_fractional_hand_family_is_dived_where_a_cold_lp_is_slow(monkeypatch):
    """Where a cold LP of the problem takes ``BRANCH_ROOT_S`` or more, a fractional family
    outside the margin is dived on the warm LP and runs no MILP: its plan is the cheaper of
    its LP's rounding and what the dive meets, between the family's exact optimum and the
    rounding. Where it is quicker (this small step), it gets branch and bound."""
    from shardprop.passes.auto import hand
    plans = _hand_plans_counting_milps(monkeypatch, *_adam_hands(batch=64, width=256, shape=(4, 2)))
    rounded, _ = plans(margin=1.0)                 # (every fractional family kept as its rounding)
    exact, milps = plans(margin=0.0, dive=True)    # (branch and bound: this small step's optimum)
    fractional = [label for label, h in rounded.items() if "not solved exactly" in h.note]
    assert fractional and milps == len(fractional)
    monkeypatch.setattr(hand, "BRANCH_ROOT_S", 0.0)
    dived, milps = plans(margin=0.0, dive=True)
    assert milps == 0
    for label in fractional:
        d = dived[label]
        assert "dive" in d.note and "its LP's bound" in d.note
        assert exact[label].time * (1 - 1e-9) <= d.time <= rounded[label].time * (1 + 1e-9)


def test_under_a_limit_a_family_whose_lp_passes_the_best_that_fits_is_given_up(monkeypatch):
    """Under a limit, once a hand plan fits, a later family's warm LP stops where its
    bound passes the best written price so far over ``WRITTEN_SHARE``: that family is
    listed with no plan. Solved to its optimum, its LP's bound is indeed above the best
    hand plan that fits over that share, and the other families' plans are as they are
    when nothing is given up."""
    from shardprop.passes.auto import hand, milp, warm_lp
    problem, memory, fams = _adam_hands(batch=64, width=256, shape=(4, 2))
    peak = lambda c: memory.peak(c)[0]   # noqa: E731
    limit = 0.9 * max(h.peak for h in hand.hand_plans(problem, peak, None, fams=fams) if h.peak)

    def model():
        return warm_lp.WarmLP(milp.reduce(problem, memory_matters=True,
                                          also=[f.allowed for f in fams if f.allowed is not None]))

    def plans():
        memo.forget()
        return {h.label: h for h in hand.hand_plans(problem, peak, limit, fams=fams, warm=model())}
    cut = plans()
    given_up = {label for label, h in cut.items() if "not solved to its optimum" in h.note}
    assert given_up and all(cut[label].time is None and cut[label].choice is None for label in given_up)
    best = min(h.written for h in cut.values() if h.fits and h.written is not None)
    lp = model()
    for f in fams:
        if f"{f.name} {f.axes}" in given_up:
            assert lp.solve(f.allowed).bound > best / hand.WRITTEN_SHARE
    monkeypatch.setattr(hand, "WRITTEN_SHARE", 1e-12)   # (a cutoff no LP reaches)
    whole = plans()
    assert not any("not solved to its optimum" in h.note for h in whole.values())
    for label, h in cut.items():
        if label not in given_up:
            assert h.time == pytest.approx(whole[label].time, rel=1e-9), label


def test_the_warm_order_changes_only_how_fast_the_hand_plans_are_solved(monkeypatch):
    """The families are solved on the warm LP from the one that narrows least, each next
    the nearest to the last; each family once, and each integral family's plan costs
    what it costs solved in the families' own order."""
    from shardprop.passes.auto import hand
    problem, memory, fams = _adam_hands(batch=1024, width=128, shape=(2, 4))
    order = hand._warm_order(problem, fams)
    assert sorted(order) == list(range(len(fams))) and fams[order[0]].name == "DP"
    plans = _hand_plans_counting_milps(monkeypatch, problem, memory, fams)

    def times():
        out, _ = plans()
        return {label: (h.time, "fractional" in h.note) for label, h in out.items()}
    mine = times()
    monkeypatch.setattr(hand, "_warm_order", lambda problem, fams: list(range(len(fams))))
    theirs = times()
    # (plans of equal cost may merge differently, "Megatron = tp+FSDP": the labels both keep)
    integral = [label for label in mine.keys() & theirs.keys() if not mine[label][1] and not theirs[label][1]]
    assert len(integral) >= 3
    for label in integral:
        assert mine[label][0] == pytest.approx(theirs[label][0], rel=1e-9), label


# -- one warm-started LP for the hand plans, the rounds and the searches again -------------

def test_warm_lp_narrowed_by_bounds_equals_each_hand_plans_own_solve():
    """The hand families solved as one LP narrowed by bounds (each from the last basis)
    reach the optimum of each family's own reduced problem solved from scratch; a memory
    row added to it gives the cold LP's bound under that row, and lifted, the LP without."""
    from shardprop.passes.auto import hand, milp, warm_lp
    from shardprop.passes.auto.problem import Problem
    from shardprop.passes.auto.search import _Liveness
    from shardprop.passes.cost import DEFAULT_COST
    assert warm_lp.available(), "highspy is a dependency of the package: its HiGHS bindings must load"
    params, x, y = problem_data(256, 64, 2)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("dp", "mp"), (2, 4)), tied=(0,))
    problem = Problem(g, DEFAULT_COST)
    fams = [f for f in hand.families(problem) if f.allowed is not None]
    assert len(fams) >= 3
    model = warm_lp.WarmLP(milp.reduce(problem, memory_matters=True, also=[f.allowed for f in fams]))
    for f in fams:
        warm = model.solve(f.allowed)
        cold = milp.solve(milp.reduce(problem, memory_matters=True, allowed=f.allowed), relax=True)
        assert warm.choice and warm.bound == pytest.approx(cold.bound, rel=1e-6, abs=1e-12), f.name
        assert all(warm.choice[t] in f.allowed[t] for t in f.allowed)
    memory = _Liveness(g, problem)
    free = model.solve()
    peak, at = memory.peak(free.choice)
    row = memory.row(at)
    limit = 0.8 * peak
    red = milp.reduce(problem, memory_matters=True)
    under = model.solve(red.kept, [row], limit)
    cold = milp.solve(red, [row], limit, relax=True)
    assert under.bound == pytest.approx(cold.bound, rel=1e-6) and under.bound > free.bound * (1 + 1e-6)   # (it binds)
    assert model.solve().bound == pytest.approx(free.bound, rel=1e-9)   # (the row lifted)


@pytest.mark.slow
def test_lp_dive_meets_the_row_near_the_exact_optimum(frac=0.7):
    """The rows' LP mixes the unlimited plan with a lean one; diving (lean candidates
    fixed where they save bytes most cheaply, the LP solved again from its basis)
    gives a plan that meets the row, at least the LP's bound, and within 1% of the
    exact optimum under that row (where rounding each decision to its heaviest
    candidate and switching the rest to their leanest was 1.4-5x above it)."""
    from shardprop.passes.auto import milp, warm_lp
    from shardprop.passes.auto.memory import plan_profile
    from shardprop.passes.auto.search import _dive
    assert warm_lp.available(), "highspy is a dependency of the package: its HiGHS bindings must load"
    problem, memory, red, model, rows, limit, lp, at = row_lp(frac)
    dived = _dive(lp, model, red, rows, limit, None, problem)
    assert dived is not None
    assert plan_profile(problem.graph, *problem.op_strategies(dived))[at] <= limit
    exact = milp.solve(red, rows, limit, 60)
    assert lp.bound <= problem.objective(exact.choice) * (1 + 1e-9)
    assert problem.objective(exact.choice) * (1 - 1e-9) <= problem.objective(dived) <= \
        problem.objective(exact.choice) * 1.01


def test_warm_lp_time_limit_is_per_solve_not_the_instances_clock():
    """HiGHS holds its time_limit against the instance's run clock, which goes on across
    runs: a warm model's re-solve given less than the seconds already run must still
    finish (it timed out at once, and the search fell back to a hand plan)."""
    from shardprop.passes.auto import hand, milp, warm_lp
    from shardprop.passes.auto.problem import Problem
    from shardprop.passes.cost import DEFAULT_COST
    assert warm_lp.available(), "highspy is a dependency of the package: its HiGHS bindings must load"
    params, x, y = problem_data(256, 64, 2)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("dp", "mp"), (2, 4)), tied=(0,))
    problem = Problem(g, DEFAULT_COST)
    fam = next(f for f in hand.families(problem) if f.allowed is not None)
    model = warm_lp.WarmLP(milp.reduce(problem, memory_matters=True, also=[fam.allowed]))
    assert model.solve().choice and model.h.getRunTime() > 0
    # (a narrowing: pivots to make, so HiGHS looks at its clock; given the seconds as they
    # were, it stopped at once)
    narrowed = model.solve(fam.allowed, time_limit=model.h.getRunTime() / 2)
    assert narrowed.choice and not getattr(narrowed, "timed_out", False)
    cold = milp.solve(milp.reduce(problem, memory_matters=True, allowed=fam.allowed), relax=True)
    assert narrowed.bound == pytest.approx(cold.bound, rel=1e-6)


def test_a_hand_family_over_the_limit_for_time_alone_is_solved_under_it():
    """A hand family whose time-optimal plan is over the limit is solved again under it,
    on its own candidates: the Megatron family (weights split over both axes) of the
    2-layer SGD step on 2 x 4 at 0.7 of the free peak, over it for time alone, fits
    (an engineer's plan of that name frees each gathered weight after its use), so the
    search has it to hold its plan to."""
    from shardprop.passes.auto import SearchStrategies, hand
    from shardprop.passes.auto.problem import Problem
    from shardprop.passes.auto.search import _Liveness, _warm_model
    from shardprop.passes.cost import DEFAULT_COST
    params, x, y = problem_data(256, 64, 2)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("dp", "mp"), (2, 4)), tied=(0,))
    problem = Problem(g, DEFAULT_COST)
    memory = _Liveness(g, problem)
    free = hand.hand_plans(problem, lambda c: memory.peak(c)[0], None)
    fam = next(f for f in hand.families(problem) if f.name == "Megatron" and "dp over" not in f.axes)
    over = next(h for h in free if h.name.startswith("Megatron") and h.axes == fam.axes)
    limit = 0.9 * over.peak
    st = SearchStrategies(memory_limit=limit)
    memo.forget()
    warm = _warm_model(problem, memory, [fam])
    fitted = hand.hand_plans(problem, lambda c: memory.peak(c)[0], limit, fams=[fam], warm=warm,
                             fit=lambda allowed, c: st._fit_hand(problem, memory, limit, allowed, c))
    (h,) = fitted
    assert h.fits and h.peak <= limit < over.peak, (h, over)
    assert all(h.choice[t] in fam.allowed[t] for t in fam.allowed)   # (the family's storage layouts)
    assert h.time >= over.time * (1 - 1e-9)                          # (the time-optimal one is the least)
    assert "solved under it" in h.note
    unfitted = hand.hand_plans(problem, lambda c: memory.peak(c)[0], limit, fams=[fam])
    assert not unfitted[0].fits   # (without the solve under the limit: over it)


def test_a_hand_plan_picked_by_name_is_solved_under_the_limit_whatever_the_others_cost():
    """The hand plans over the limit are solved under it only while one could be the best
    that fits; ``every=True`` (a plan picked by name, which measure=True compiles and times)
    solves each. At 0.9 of the largest free peak on the 2-layer SGD step on 2 x 4, Megatron
    with weights split over both axes is over the limit and, cheaper plans fitting, was
    left unsolved: picked by name it was "not planned"."""
    from shardprop.passes.auto import SearchStrategies, hand
    from shardprop.passes.auto.problem import Problem
    from shardprop.passes.auto.search import _Liveness, _warm_model
    from shardprop.passes.cost import DEFAULT_COST
    params, x, y = problem_data(256, 64, 2)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("dp", "mp"), (2, 4)), tied=(0,))
    problem = Problem(g, DEFAULT_COST)
    memory = _Liveness(g, problem)
    peak = lambda c: memory.peak(c)[0]   # noqa: E731
    limit = 0.9 * max(h.peak for h in hand.hand_plans(problem, peak, None) if h.peak)
    st = SearchStrategies(memory_limit=limit)
    fams = hand.families(problem)
    label = next(f"{f.name} {f.axes}" for f in fams if f.name == "Megatron" and "dp over" not in f.axes)
    solved = {}
    for every in (False, True):
        memo.forget()
        out = hand.hand_plans(problem, peak, limit, fams=fams, warm=_warm_model(problem, memory, fams),
                              fit=lambda allowed, c: st._fit_hand(problem, memory, limit, allowed, c), every=every)
        solved[every] = next(h for h in out if h.label == label)
    assert not solved[False].fits and "not solved under the limit" in solved[False].note
    assert solved[True].fits and solved[True].peak <= limit and "solved under it" in solved[True].note


def _search_seeding_rows(monkeypatch, g, fraction: float):
    """One search of ``g`` under ``fraction`` of its free plan's peak, watching the rows its
    LP rounds are seeded with: (hand plans, plan, peak, limit, the seed's rows, and a
    function giving the point where a choice peaks)."""
    from shardprop.passes.auto import SearchStrategies, hand
    from shardprop.passes.auto.memory import plan_profile
    _, _, free_peak = SearchStrategies().search(g)
    limit = int(fraction * free_peak)
    memo.forget()
    seeds = []
    inner = SearchStrategies._solve_under_limit

    def spy(self, red, problem, memory, limit, smallest, start=None, seed=(), **kw):
        seeds.append((list(seed), problem))
        return inner(self, red, problem, memory, limit, smallest, start, seed, **kw)
    monkeypatch.setattr(SearchStrategies, "_solve_under_limit", spy)
    st = SearchStrategies(memory_limit=limit, exact_ops=0)
    _, sol, peak = st.search(g)
    (seed, problem), = seeds

    def peaks_at(choice) -> int:
        return int(np.argmax(plan_profile(g, *problem.op_strategies(choice))))
    return [h for h in st._hands if h.time is not None], sol, peak, limit, seed, peaks_at


@pytest.mark.slow
def test_where_every_hand_plan_fits_the_first_row_is_where_the_cheapest_peaks(monkeypatch):
    """No hand plan over the limit: the LP rounds start from the row where the cheapest
    hand plan peaks (every plan that fits meets it), with no exact unlimited solve to
    find a first row; the plan fits and is no dearer than that hand plan."""
    params, x, y = problem_data(256, 64, 2)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("dp", "mp"), (2, 4)), tied=(0,))
    hands, sol, peak, limit, seed, peaks_at = _search_seeding_rows(monkeypatch, g, 0.85)
    assert hands and all(h.fits for h in hands)
    cheapest = min(hands, key=lambda h: h.time)
    assert seed == [peaks_at(cheapest.choice)]
    assert peak <= limit and sol.objective <= cheapest.time * (1 + 1e-9)


@pytest.mark.slow
def test_the_lp_rounds_start_from_one_row_where_the_first_hand_plan_over_the_limit_peaks(monkeypatch):
    """Hand plans over the limit: the LP rounds are seeded with one row, where the first of
    them (in the families' order: DP's, which narrows least) peaks, not every such plan's
    (each row makes the LP's iterations dearer); the rounds add the rows they need, and the
    plan fits and is no dearer than the best hand plan that fits."""
    fn, args = adam_case(batch=64, width=256)
    g = traced_graph(fn, args, Mesh(("dp", "mp"), (2, 4)), tied=(0, 1))
    hands, sol, peak, limit, seed, peaks_at = _search_seeding_rows(monkeypatch, g, 0.5)
    over = [h for h in hands if not h.fits]
    assert len(over) >= 2 and over[0].name == "DP"   # (DP and Megatron, here)
    assert seed == [peaks_at(over[0].choice)]
    assert peak <= limit
    fitting = [h.time for h in hands if h.fits]
    assert not fitting or sol.objective <= min(fitting) * (1 + 1e-9)


# -- a copy several ops read is priced once, as written ----------------------------------------

def norm_mlp_step(params, x, y):
    """A layer norm before a two-matmul block, an SGD step: split over the model axis
    (Megatron), the norm's gradient is a partial sum that three of its backward ops read."""
    def loss(p):
        w1, w2 = p
        mu = x.mean(-1, keepdims=True)
        h = (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
        return (((jax.nn.gelu(h @ w1) @ w2) - y) ** 2).mean()
    g = jax.grad(loss)(params)
    return jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g)


def norm_mlp_args(batch=32, width=64):
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((width, 4 * width), dtype=np.float32) * 0.1
    w2 = rng.standard_normal((4 * width, width), dtype=np.float32) * 0.1
    x = rng.standard_normal((batch, width), dtype=np.float32)
    return (w1, w2), x, rng.standard_normal((batch, width), dtype=np.float32)


@pytest.mark.slow
def test_hand_plans_are_priced_as_written_and_the_search_is_never_above_the_best():
    """The objective moves a value once per reader; the program (insert-reshards) once per
    layout. A hand plan is priced both ways (never more as written), and the search's
    plan, as written, is at most the best fitting hand plan's written price: where the
    per-reader objective ranks a plan that reads a copy several times above another
    that the written prices rank below it, the hand plan is returned."""
    from shardprop.passes.auto import SearchStrategies
    from shardprop.passes.cost import CostModel
    args = norm_mlp_args()
    g = traced_graph(norm_mlp_step, args, Mesh(("dp", "mp"), (2, 4)), tied=(0,))
    cpu = CostModel.builtin("cpu")   # (its collectives' wait makes a copy counted twice matter)
    _, free, free_peak = SearchStrategies(cpu).search(g)
    s = SearchStrategies(cpu, memory_limit=int(0.6 * free_peak))
    problem, sol, peak = s.search(g)
    hands = [h for h in s._hands if h.time is not None]
    assert hands and all(h.written <= h.time * (1 + 1e-12) for h in hands)
    # (the norm's partial gradient under tp+FSDP: one all_reduce read by several ops, counted
    # once per reader by the objective)
    assert any(h.written < h.time * (1 - 1e-6) for h in hands)
    fitting = [h for h in hands if h.fits]
    assert fitting and peak <= 0.6 * free_peak
    assert problem.written(*sol.plan) <= min(h.written for h in fitting) * (1 + 1e-9)


def test_written_price_is_at_most_the_objectives():
    """``Problem.written`` is the evaluator with a copy made once per layout (as
    propagation prices a written plan): at most the objective's price of the plan, and
    what ``plan.cost.written_time`` reports."""
    from shardprop.passes.auto import SearchStrategies
    args = norm_mlp_args()
    g = traced_graph(norm_mlp_step, args, Mesh(("dp", "mp"), (2, 4)), tied=(0,))
    problem, sol, _ = SearchStrategies().search(g)
    ops, inputs = sol.plan
    e = problem.evaluate(ops, inputs)
    assert problem.written(ops, inputs) <= e["compute"] + e["communication"] + 1e-15
    plan = sp.parallelize(norm_mlp_step, mesh=((2, 4), ("dp", "mp")), mode="auto", progress=False).plan(*args)
    assert plan.cost.written_time is not None and plan.cost.written_time <= plan.cost.step_time * (1 + 1e-12)




def test_a_transpose_or_reshape_is_a_view_of_its_operands_buffer():
    """XLA writes a transpose or a reshape as a bitcast of its operand's buffer (or folds
    it into the dot that reads it), so the model counts a view only where no value of its
    buffer is alive already: a value read only through its views is counted once, at
    every point up to the views' last reader; views of a value alive anyway cost
    nothing; a view the function returns is its own output buffer. The search's rows
    (``_Liveness``) count what ``plan_profile`` counts at every program point."""
    import jax.numpy as jnp
    from shardprop.passes.auto import SearchStrategies
    from shardprop.passes.auto.memory import live_intervals, plan_profile, views
    from shardprop.passes.auto.search import _Liveness

    def through_views(x, w):
        h = x @ w                               # (64, 32), read only through its views
        return jnp.sum(jnp.cos(h.T.reshape(32, 8, 8)) * 2.0)

    def also_returned(x, w):
        h = x @ w
        return jnp.sum(jnp.cos(h.T.reshape(32, 8, 8)) * 2.0), h.T
    x, w = np.ones((64, 128), np.float32), np.ones((128, 32), np.float32)
    mesh = Mesh(("a", "b"), (2, 4))
    for fn in (through_views, also_returned):
        g = traced_graph(fn, (x, w), mesh)
        intervals, seen = live_intervals(g), views(g)
        pos = {op: t for t, op in enumerate(g.ops)}
        dot, cos = (next(op for op in g.ops if op.kind == k) for k in ("dot_general", "cos"))
        h = dot.outputs[0]
        inner = [op.outputs[0] for op in g.ops
                 if op.kind in ("transpose", "reshape") and op.outputs[0] not in g.outputs]
        assert len(inner) == 2 and all(seen[v][1] is h for v in inner) and cos.inputs[0] is inner[-1]
        assert all(v not in seen and intervals[v] == (-1, len(g.ops)) for v in g.outputs)
        group = [v for v in [h] + inner if v in intervals]
        for t in range(pos[dot], pos[cos] + 1):     # one buffer alive from h's op to the last view's reader
            assert sum(intervals[v][0] <= t <= intervals[v][1] for v in group) == 1, (fn.__name__, t)
        if fn is also_returned:                     # h is read at the end: its views cost nothing
            assert group == [h]

        problem, sol, _ = SearchStrategies().search(g)
        memory = _Liveness(g, problem)
        rng = np.random.default_rng(0)      # and random plans
        choices = [sol.choice] + [{t: int(rng.integers(len(u))) for t, u in problem.unary.items()} for _ in range(20)]
        for choice in choices:
            ops, inputs = problem.op_strategies(choice)
            prof = plan_profile(g, ops, inputs)
            for at in range(len(prof)):
                row = memory.row(at)
                counted = sum(float(vec[choice[t]]) for t, vec in row.nodes.items())
                counted += sum(float(b[rows[choice[a]], cols[choice[c]]]) for a, c, rows, cols, b in row.pairs)
                assert counted == pytest.approx(prof[at], rel=1e-9, abs=1e-6), (fn.__name__, at)



def test_a_view_of_a_redistributed_operand_holds_the_new_buffer():
    """A view whose operand is redistributed for it reads a new buffer: where its operand
    is alive anyway, the gathered copy is counted beside it, up to the view's last reader."""
    import dataclasses

    import jax.numpy as jnp
    from shardprop.ir.layout import Layout
    from shardprop.passes.auto import SearchStrategies
    from shardprop.passes.auto.memory import copy_bytes, local_bytes, plan_profile, view_shadows

    def f(x, w):
        h = jnp.sin(x @ w)
        return jnp.sum(jnp.cos(h.T) * 2.0), h      # h is alive to the end: its transpose is a view
    g = traced_graph(f, (np.ones((64, 128), np.float32), np.ones((128, 32), np.float32)), Mesh(("a", "b"), (2, 4)))
    problem, sol, _ = SearchStrategies().search(g)
    sin, tr, cos = (next(op for op in g.ops if op.kind == k) for k in ("sin", "transpose", "cos"))
    h, mesh = sin.outputs[0], g.mesh
    ci, _ = problem.node_of_op[sin]
    t = problem.nodes[ci].template
    split = next(k for k in range(len(problem.unary[t]))            # a plan with h split
                 if local_bytes(h, problem.op_strategies({**sol.choice, t: k})[0][sin].result_layout(0, mesh), mesh)
                 < local_bytes(h, Layout.replicated(2), mesh))
    ops, inputs = problem.op_strategies({**sol.choice, t: split})
    assert ops[tr].operand_layout(0, 2, mesh) == ops[sin].result_layout(0, mesh)     # (the view follows h)
    gathered = dataclasses.replace(ops[tr], factors=tuple(() for _ in ops[tr].factors), passthrough=None,
                                   _layouts={})      # (not the cached layouts of the split one)
    pos = g.ops.index(cos)
    # (up to the reduction the cos and its product fuse into: fused, they hold no buffer and read the view there)
    end = g.ops.index(next(op for op in g.ops if op.kind == "reduce_sum"))
    assert view_shadows(g) == {g.ops.index(tr): (pos, end)}
    before = plan_profile(g, ops, inputs)
    after = plan_profile(g, {**ops, tr: gathered}, inputs)
    whole = Layout.replicated(2)
    # at the cos: the whole transposed copy, and the slice cos takes of it
    want = local_bytes(h, whole, mesh) + copy_bytes(tr.outputs[0], whole, ops[cos].operand_layout(0, 2, mesh), mesh)
    assert after[pos + 1] - before[pos + 1] == pytest.approx(want) and want > 0


# -- the modeled peak against the compiled one -------------------------------------------------

def _gelu_mlp_adam_step(marked: bool):
    """A GELU MLP's Adam step, Megatron's two marks (column, then row split over mp) or none."""
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P
    opt = optax.adam(1e-3)

    def loss(params, x, y):
        w1, w2 = params
        up = sp.shard(jnp.matmul, (P(), P(None, "mp"))) if marked else jnp.matmul
        down = sp.shard(jnp.matmul, (P(None, "mp"), P("mp", None))) if marked else jnp.matmul
        return jnp.mean((down(jax.nn.gelu(up(x, w1)), w2) - y) ** 2)

    def step(params, state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value
    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((128, 512)) * .05).astype(np.float32),
              (rng.standard_normal((512, 128)) * .05).astype(np.float32)]
    x, y = (rng.standard_normal((256, 128)).astype(np.float32) for _ in range(2))
    return step, (params, opt.init(params), x, y)


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["marks", "DP", "tp+FSDP"])
def test_the_modeled_peak_is_what_xla_compiles(plan):
    """The modeled peak per device (``plan_peak`` of the planned strategies) is within 15% of
    the compiled program's (``memory_analysis()``: arguments + outputs + temp - aliased), on
    a GELU MLP's Adam step on 2 x 4: the GELU's fused intermediates hold no buffer and a
    mark's sharding constraint is a view of its operand (before both, the marks modeled
    at 1.48 of compiled), while what the backward reads again is held."""
    from shardprop.compiler.pipeline import default_passes
    from shardprop.passes.auto.memory import plan_peak
    kw = {"marks": {}, "DP": dict(mode="data_parallel", batch_argnums=(2, 3)),
          "tp+FSDP": dict(shard_params=True)}[plan]
    step, args = _gelu_mlp_adam_step(marked=plan != "DP")
    pf = sp.parallelize(step, mesh=((2, 4), ("dp", "mp")), donate_argnums=(0, 1), progress=False, **kw)
    g, _ = pf._trace(args, {})
    bind, choose = default_passes(pf.options)[:2]
    g = choose(bind(g))
    modeled = plan_peak(g, {op: op.strategy for op in g.ops}, {i: v.layout for i, v in enumerate(g.inputs)})
    m = pf.lower(*args).compile().memory_analysis()
    compiled = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    assert 0.85 <= modeled / compiled <= 1.15, (plan, modeled, compiled)


@pytest.mark.slow
def test_the_moves_of_a_plan_priced_on_autos_problem_add_up_to_its_written_price():
    """``bench/auto_marks.py`` splits a plan's moves as written by what they move (stored
    values gathered at their use, terminal values, the rest), with the part that is the
    profile's wait after compute: the split is the written price's communication, all of
    it, and the bench's tp+FSDP (the marks, shard_params=True) gathers its stored weights."""
    from bench import zoo as bench_zoo
    from bench.auto_marks import marks_on_the_problem, marks_plan, unmarked_problem
    from shardprop.passes.cost import CostModel
    c = next(x for x in bench_zoo.cases() if x.name == "gpt2_train_dp2xmp4")
    problem = unmarked_problem(c, c.mesh, "cpu", c.args())[1]
    on = marks_on_the_problem(problem, marks_plan(c, c.mesh, "cpu", c.args(), shard_params=True))
    assert on["same_ops"] and not on["missing"]
    moved = sum(t for _, t, _ in on["moves"].values())
    assert set(on["moves"]) <= {"stored", "terminal", "value"} and on["moves"]["stored"][0] > 0
    cpu = CostModel.builtin("cpu")
    least = min(w for _, w in cpu.waits) if cpu.waits else cpu.sync_s   # (the smallest group's wait)
    for what, (n, t, wait) in on["moves"].items():
        assert 0 < wait < t, what        # (a collective pays its wait and more)
        if what != "terminal":
            assert wait >= n * least * (1 - 1e-9), what   # (each move waits once, in full, for its group)
    assert moved == pytest.approx(on["written"] - on["compute"], rel=1e-9), (moved, on["written"], on["compute"])


def test_a_hand_plan_is_made_to_fit_by_the_copies_at_its_peak_too():
    """A weight stored split and gathered at its use holds the gather's bytes at the
    matmul: a copy between two decisions (a memory row's pair), which FSDP's peak is
    made of. The repair (``repair.py``) weighs what every switch saves at the peak:
    its values' bytes and every copy it is an end of, each as the bytes at that point
    with the switch made (checked against the row summed again, on random rows)."""
    from shardprop.passes.auto.milp import MemoryRow
    from shardprop.passes.auto.repair import _deciders, _saved_at
    rng = np.random.default_rng(3)
    for _ in range(20):
        sizes = {t: int(rng.integers(2, 6)) for t in range(4)}
        nodes = {t: rng.random(sizes[t]) for t in (0, 1)}
        pairs = []
        for a, b in ((1, 2), (2, 3), (0, 3)):
            ra, cb = rng.integers(0, 3, sizes[a]), rng.integers(0, 2, sizes[b])
            pairs.append((a, b, ra, cb, rng.random((3, 2))))
        row = MemoryRow(nodes, pairs)
        choice = {t: int(rng.integers(k)) for t, k in sizes.items()}

        def held(c):
            return sum(v[c[t]] for t, v in nodes.items()) + sum(m[ra[c[a]], cb[c[b]]] for a, b, ra, cb, m in pairs)
        assert sorted(_deciders(row)) == [0, 1, 2, 3]     # (2 and 3 hold only copies' bytes)
        for t in sizes:
            cands = np.arange(sizes[t])
            expect = [held(choice) - held({**choice, t: int(k)}) for k in cands]
            np.testing.assert_allclose(_saved_at(row, choice, t, cands), expect, rtol=0, atol=1e-12)


class _ToyProblem:
    """Decisions with a price per candidate and no edges (what ``fit_by_switching`` reads)."""

    def __init__(self, unary):
        self.unary = {t: np.asarray(u, float) for t, u in unary.items()}

    def switch_deltas(self, choice, t):
        return self.unary[t] - self.unary[t][choice[t]]

    def objective(self, choice):
        return sum(float(self.unary[t][k]) for t, k in choice.items())


class _ToyMemory:
    """Bytes per decision, candidate and program point: a profile is their sum."""

    def __init__(self, held):
        self.held = {t: np.asarray(h, float) for t, h in held.items()}   # t -> [candidate, point]

    def profile(self, choice):
        return sum(self.held[t][k] for t, k in choice.items())

    def switched(self, choice, prof, t, k):
        return prof - self.held[t][choice[t]] + self.held[t][k]

    def row(self, at):
        from shardprop.passes.auto.milp import MemoryRow
        return MemoryRow({t: h[:, at] for t, h in self.held.items()}, [], at)


def test_a_plan_is_made_to_fit_by_switches_that_push_no_other_point_over_the_limit():
    """At the peak, the cheapest switch per byte saved can hold more at another point than
    the limit: taken, the peak only moves there, the switch back is then the cheapest, and
    the repair went round until it gave up (a rounding of the search's LP under half the
    free peak of the 2-layer GPT step on 4 x 2 stalled so in 5 of 8 rounds). A switch that
    saves bytes at the peak without pushing another point over the limit goes first."""
    from shardprop.passes.auto.repair import fit_by_switching
    # point 0 holds 12 bytes over a limit of 10; decision 0's lean candidate (1 s dearer)
    # saves 6 there and puts 7 more on point 1 (4 -> 11); decision 1's (10 s dearer) saves 3
    problem = _ToyProblem({0: [0.0, 1.0], 1: [0.0, 10.0], 2: [0.0]})
    memory = _ToyMemory({0: [[8, 2], [2, 9]], 1: [[4, 2], [1, 2]], 2: [[0, 0]]})
    fitted = fit_by_switching(problem, memory, 10.0, {0: 0, 1: 0, 2: 0})
    assert fitted == {0: 0, 1: 1, 2: 0}
    assert memory.profile(fitted).max() <= 10.0


def test_a_rounding_over_the_limit_where_the_lp_has_every_row_is_repaired_to_a_plan(monkeypatch):
    """Where no rounding of the rows' LP fits and each overflows only where the LP already
    has a row (a new row would not move the LP), the heaviest rounding is made to fit by
    switching (``repair.py``) and offered as the LP rounds' plan, before any dive: on the
    2-layer GPT step on 4 x 2 at half the free peak the search had found no plan of its own
    in its budget. Here (an SGD step on 4 x 2 at half the free peak) the repaired plans fit,
    are priced at least at the LP's bound, and the search returns none dearer."""
    from shardprop.passes.auto import SearchStrategies, search
    params, x, y = problem_data(512, 256, 2)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("a", "b"), (4, 2)), tied=(0,))
    _, free, free_peak = SearchStrategies().search(g)
    limit = int(0.5 * free_peak)
    repaired, offered = [], []
    fit = search.fit_by_switching

    def spy(problem, memory, lim, choice, allowed=None, deadline=None):
        out = fit(problem, memory, lim, choice, allowed, deadline)
        if allowed is not None and out is not None and lim == limit:
            repaired.append((problem.objective(out), memory.peak(out)[0]))
        return out
    monkeypatch.setattr(search, "fit_by_switching", spy)
    offer = search._Best.offer
    monkeypatch.setattr(search._Best, "offer", lambda self, c, part, how: offered.append(
        (part, self.problem.objective(c))) or offer(self, c, part, how))
    searcher = SearchStrategies(memory_limit=limit)
    _, sol, peak = searcher.search(g, hands=False)   # (no hand plans: every repair is a rounding's)
    assert repaired, "no rounding was repaired"
    assert all(p <= limit for _, p in repaired)
    lp_offers = [t for part, t in offered if part == "the LP rounds"]
    assert any(t == pytest.approx(r, rel=1e-12) for r, _ in repaired for t in lp_offers)
    assert all(t >= searcher._bound * (1 - 1e-9) for t, _ in repaired)
    assert peak <= limit and sol.objective <= min(t for t, _ in repaired) * (1 + 1e-9)


@pytest.mark.slow
def test_a_dive_from_a_plan_outside_the_gap_is_brief(monkeypatch):
    """A dive from a plan that fits but is outside the search's gap (``dive_far``) gets at
    most ``DIVE_FAR_S``, not the rest of the budget: on the GPT steps on 4 x 2 at 0.5 such
    dives ran to the budget's end (5.5-14.3 s) and found nothing cheaper. The first, before
    the multipliers, gets at most ``DIVE_FAR_FIRST_S``."""
    import time
    from shardprop.passes.auto import SearchStrategies, lagrange, search
    params, x, y = problem_data(512, 256, 2)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("a", "b"), (4, 2)), tied=(0,))
    _, free, free_peak = SearchStrategies().search(g)
    dives = []
    real = search._dive

    def spy(lp, warm, red, rows, limit, deadline, problem, **kw):
        incumbent, enough = kw.get("incumbent"), kw.get("enough")
        far = incumbent is not None and (enough is None or incumbent[0] > enough)
        dives.append((far, np.inf if deadline is None else deadline - time.perf_counter()))
        return real(lp, warm, red, rows, limit, deadline, problem, **kw)
    monkeypatch.setattr(search, "_dive", spy)
    multipliers = lagrange.search
    monkeypatch.setattr(lagrange, "search", lambda *a, **k: dives.append(("multipliers", None)) or multipliers(*a, **k))
    limit = int(0.5 * free_peak)
    _, sol, peak = SearchStrategies(memory_limit=limit).search(g)
    far = [left for is_far, left in dives if is_far is True]
    assert far, "no dive from a plan outside the gap"
    assert all(left <= search.DIVE_FAR_S + 1e-6 for left in far)
    first = [d[0] for d in dives].index("multipliers")
    assert first > 0 and dives[first - 1][0] is True, "no dive from the plan before the multipliers"
    assert dives[first - 1][1] <= search.DIVE_FAR_FIRST_S + 1e-6
    assert sol is not None and peak <= limit


def test_a_refinement_dearer_as_written_is_not_kept(monkeypatch):
    """Refinement lowers the objective (a copy priced once per reader), not always the plan
    as the program is written (a copy several ops read made once), which is what the search
    compares with the hand plans: on the 4-layer GPT step on 2 x 4 at 0.9 it took the
    search's plan from 35.99 to 36.96 ms as written, above Megatron's 36.57. A refinement
    dearer as written is dropped (here one made up: each decision at a random candidate,
    claiming a large gain); a real one is kept only where it is no dearer."""
    from shardprop.passes.auto import SearchStrategies, search
    params, x, y = problem_data(512, 256, 2)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("a", "b"), (2, 4)), tied=(0,))
    problem, solved, _ = SearchStrategies().search(g, refine=False)
    unrefined = problem.written(*solved.plan)
    rng = np.random.default_rng(0)
    made = problem.op_strategies({t: int(rng.integers(len(u))) for t, u in problem.unary.items()})
    assert problem.written(*made) > unrefined * 1.01
    real = search.refine
    kept = []

    def made_up(problem, ops, inputs, **kw):
        return made + (solved.objective,)
    monkeypatch.setattr(search, "refine", made_up)
    problem, sol, _ = SearchStrategies().search(g)
    assert problem.written(*sol.plan) == pytest.approx(unrefined, rel=1e-12)
    assert sol.claimed == sol.objective        # (no gain claimed for a refinement not kept)

    def spied(problem, ops, inputs, **kw):
        out = real(problem, ops, inputs, **kw)
        kept.append((problem.written(ops, inputs), problem.written(*out[:2])))
        return out
    monkeypatch.setattr(search, "refine", spied)
    problem, sol, _ = SearchStrategies().search(g)
    before, after = kept[-1]
    assert problem.written(*sol.plan) == pytest.approx(min(before, after), rel=1e-12)
