"""mode="auto"'s time budget: ``parallelize(..., search_seconds=)`` is what the searches
of one compile get in all, and where it runs out before any plan fits, the error says
so and names the knob (it does not claim that no plan fits)."""
import sys
from pathlib import Path

import pytest

import shardprop as sp
from shardprop.compiler import pipeline as compile_pipeline
from shardprop.ir.mesh import Mesh
from shardprop.passes.auto import SearchStrategies
from shardprop.passes.auto.problem import Problem
from shardprop.passes.cost import DEFAULT_COST

sys.path.insert(0, str(Path(__file__).parent))
from test_auto import problem_data, sgd_step, traced_graph  # noqa: E402


@pytest.mark.parametrize("bad", [0, -1.0, "10", True])
def test_search_seconds_must_be_a_positive_number(bad):
    with pytest.raises(sp.ShardingError, match="search_seconds"):
        sp.parallelize(sgd_step, mesh=8, mode="auto", memory_limit=10**6, search_seconds=bad)


def test_search_seconds_with_a_pipeline_is_refused_by_name():
    with pytest.raises(sp.ShardingError, match="search_seconds"):
        sp.parallelize(sgd_step, mesh=((2, 4), ("pp", "mp")), mode="auto", pipeline=sp.Pipeline(microbatches=2),
                       search_seconds=5)


def test_the_compiles_searches_get_search_seconds(monkeypatch):
    seen = []

    class Recording(SearchStrategies):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen.append((self.time_budget, self.deadline))
    monkeypatch.setattr(compile_pipeline, "SearchStrategies", Recording)
    import time
    params, x, y = problem_data(64, 64, 2)
    t0 = time.perf_counter()
    sp.parallelize(sgd_step, mesh=((2, 4), ("dp", "mp")), mode="auto", memory_limit=4 * 2**20, search_seconds=7,
                   progress=False).plan(params, x, y)
    assert seen and all(budget == 7 for budget, _ in seen)
    # (one deadline for the compile's searches: 7 s from its start)
    assert all(deadline is not None and t0 < deadline <= t0 + 7 + 1 for _, deadline in seen)


def test_out_of_time_before_any_plan_says_so_and_names_the_knob():
    params, x, y = problem_data(64, 64, 2)
    g = traced_graph(sgd_step, (params, x, y), Mesh(("dp", "mp"), (2, 4)), tied=(0,))
    search = SearchStrategies(memory_limit=10**5, time_budget=3)
    err = search._overflow(Problem(g, DEFAULT_COST), out_of_time="Time limit reached")
    text = str(err)
    assert "within its time budget of 3 s" in text and "search_seconds" in text and "memory_limit=100,000" in text
    assert "no plan fits" not in text   # (running out of time proves nothing)
    plain = str(search._overflow(Problem(g, DEFAULT_COST)))
    assert plain.startswith("no plan fits") and "search_seconds" not in plain


@pytest.mark.parametrize("left, seconds", [(15.0, 15.0), (5.0, 10.0), (0.0, 10.0), (-3.0, 7.0), (-12.0, -2.0)])
def test_the_multipliers_grace_past_the_budget_is_one_for_the_compile(monkeypatch, left, seconds):
    """The last resort (multipliers, where the exact rows found no plan in time) runs at
    least MULTIPLIERS_MIN_S, but no later than that past the budget's end, which the
    compile's searches share: a search begun after the grace gets none."""
    from shardprop.passes.auto import search as search_module
    monkeypatch.setattr(search_module, "MULTIPLIERS_MIN_S", 10.0)
    s = SearchStrategies(time_limit=None)
    monkeypatch.setattr(s, "_left", lambda: left)
    assert s._multipliers_seconds() == pytest.approx(seconds)
    s._left = lambda: None
    assert s._multipliers_seconds() is None   # (no budget: the solve's own time limit, here none)
