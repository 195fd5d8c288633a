"""The search's shortcuts under a memory limit keep its promises: LP diving stops at a
plan it cannot beat by more than ``DIVE_STOP`` and returns the cheapest plan that fits
it met; an arrangement that runs out of time leaves the others' plans standing."""
import sys
from pathlib import Path

import pytest

from shardprop.ir.errors import ShardingError
from shardprop.ir.mesh import Mesh

sys.path.insert(0, str(Path(__file__).parent))
from test_auto import row_lp  # noqa: E402


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
