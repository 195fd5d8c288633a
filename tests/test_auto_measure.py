"""mode="auto", measure=True: the search's plan and the hand plans priced close to it
are compiled and timed, and the fastest is kept (compiler/measure.py)."""
import sys
from pathlib import Path

import jax
import pytest

import shardprop as sp
from shardprop.compiler import measure

sys.path.insert(0, str(Path(__file__).parent))
from test_auto import assert_close, problem_data, sgd_step  # noqa: E402

MESH = ((2, 4), ("dp", "mp"))


def measured_step(**kw):
    params, x, y = problem_data(64, 256, 2)
    pf = sp.parallelize(sgd_step, mesh=MESH, mode="auto", cost_model="cpu", measure=True, progress=False, **kw)
    return pf, (params, x, y)


@pytest.mark.slow
def test_the_fastest_measured_plan_is_kept_and_equals_one_device():
    pf, args = measured_step()
    plan = pf.plan(*args)
    timed = [m for m in plan.cost.measured if m.seconds is not None]
    assert timed[0].name == "search" and len(timed) >= 2          # the search's plan and a hand plan at least
    kept = [m for m in timed if m.note == "kept"]
    assert len(kept) == 1 and kept[0].seconds == min(m.seconds for m in timed)
    assert all(m.modeled <= measure.MEASURE_WITHIN * timed[0].modeled * (1 + 1e-9) for m in timed)
    assert "measured (measure=True" in str(plan.cost)
    assert_close(pf(*args), jax.jit(sgd_step)(*args))


@pytest.mark.slow
def test_a_hand_plan_measured_faster_is_the_program_that_runs(monkeypatch):
    # the clock says the last hand plan timed is the fastest: its program is what runs
    monkeypatch.setattr(measure, "median_steps", lambda steps, reps=measure.MEASURE_REPS:
                        [1.0] * (len(steps) - 1) + [0.5])
    pf, args = measured_step()
    plan = pf.plan(*args)
    kept = next(m for m in plan.cost.measured if m.note == "kept")
    assert kept.name != "search"
    assert plan.cost.solver["status"].startswith(f"the hand plan {kept.name}")
    # the hand plan as the search wrote it: priced as written no dearer than the hand plan itself
    assert plan.cost.written_time <= kept.modeled * (1 + 1e-9)
    assert_close(pf(*args), jax.jit(sgd_step)(*args))


@pytest.mark.slow
def test_a_plan_over_the_memory_limit_is_not_timed():
    params, x, y = problem_data(64, 256, 2)
    free = sp.parallelize(sgd_step, mesh=MESH, mode="auto", cost_model="cpu", progress=False).plan(params, x, y)
    limit = int(free.cost.peak_memory * 0.8)
    pf = sp.parallelize(sgd_step, mesh=MESH, mode="auto", cost_model="cpu", measure=True, progress=False,
                        memory_limit=limit)
    plan = pf.plan(params, x, y)
    assert plan.cost.compiled_memory.total <= limit
    for m in plan.cost.measured:
        assert m.seconds is not None or "over the limit" in m.note or "not planned" in m.note
    assert_close(pf(params, x, y), jax.jit(sgd_step)(params, x, y))


def test_candidates_are_the_close_hand_plans_that_fit_one_per_price():
    from shardprop.passes.auto.hand import HandPlan
    plans = [HandPlan("DP", "a", 1.0, 1.0, 10, True, {0: 0}), HandPlan("ZeRO-1", "a", 1.2, 1.2, 5, True, {0: 1}),
             HandPlan("FSDP", "a", 1.2, 1.2, 4, True, {0: 2}), HandPlan("Megatron", "b", 1.9, 1.9, 4, True, {0: 3}),
             HandPlan("tp+FSDP", "b", 1.1, 1.1, 99, False, {0: 4}), HandPlan("x", "c", note="n/a")]
    assert [h.name for h in measure.candidates(plans, 1.0)] == ["DP", "ZeRO-1"]
    # under a limit, what the model puts under the user's limit (not under a lower one the
    # memory check set for the search's own plan): the compiled peak decides after
    assert [h.name for h in measure.candidates(plans, 1.0, limit=6)] == ["ZeRO-1"]
    assert [h.name for h in measure.candidates(plans, 1.0, limit=100)] == ["DP", "tp+FSDP", "ZeRO-1"]


@pytest.mark.parametrize("kw, says", [(dict(mode="sharding_propagation"), "only mode='auto'"),
                                       (dict(mode="auto", mesh=jax.sharding.AbstractMesh((4, 4), ("dp", "mp"))),
                                        "devices that are not here")])
def test_measure_without_what_it_needs_is_refused(kw, says):
    kw = dict(dict(mesh=MESH), **kw)
    with pytest.raises(sp.ShardingError, match=says) as e:
        sp.parallelize(sgd_step, measure=True, **kw)
    assert "drop measure=True" in str(e.value) and "test_auto_measure.py" in str(e.value)


def test_measure_with_a_pipeline_is_refused():
    with pytest.raises(sp.ShardingError, match="measure"):
        sp.parallelize(sgd_step, mesh=((2, 4), ("pp", "mp")), mode="auto", measure=True,
                       pipeline=sp.Pipeline(microbatches=2))


@pytest.mark.slow
def test_a_hand_plan_that_fits_once_compiled_is_returned_where_no_searched_plan_does(monkeypatch):
    # the search's plan compiles over the limit (its check made to read 64 MiB more) and no
    # further round is allowed: the hand plans it compared with are compiled in turn, and
    # the cheapest whose compiled peak fits is returned, not a "no plan fits" error
    from dataclasses import replace
    from shardprop.compiler import api, memory_check
    params, x, y = problem_data(64, 256, 2)
    free = sp.parallelize(sgd_step, mesh=MESH, mode="auto", cost_model="cpu", progress=False).plan(params, x, y)
    limit = int(free.cost.peak_memory * 0.9)   # (FSDP's modeled peak is under it)
    checks = []

    def first_over(jitted, abstract):
        used = memory_check.compiled_memory(jitted, abstract)
        checks.append(used)
        return replace(used, temp=used.temp + 64 * 2**20) if len(checks) == 1 else used
    monkeypatch.setattr(api, "compiled_memory", first_over)
    monkeypatch.setattr(api.ModeledLimits, "next", lambda self: None)
    pf = sp.parallelize(sgd_step, mesh=MESH, mode="auto", cost_model="cpu", progress=False, memory_limit=limit)
    plan = pf.plan(params, x, y)
    assert len(checks) >= 2 and "no searched plan fit the limit once compiled" in plan.cost.solver["status"]
    assert plan.cost.compiled_memory.total <= limit and plan.cost.memory_limit == limit
    assert plan.cost.solver["status"].startswith("the hand plan ")
    assert_close(pf(params, x, y), jax.jit(sgd_step)(params, x, y))
