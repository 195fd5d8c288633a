"""When the searched plan compiles over the memory limit, the memory check searches again
under a lower modeled limit, which holds the hand plans to the searched plan's overshoot
too. A hand plan modeled under the user's limit and cheaper as written may compile under
it: it is compiled, and kept where it fits (``compiler/api.py`` ``_fit_compiled``, by
``_hand_that_fits(below=)``). Before, the 2-layer GPT step on 4 x 2 at 0.9 of the free
plan's peak returned a plan modeled 1.55x its ZeRO-1 hand plan (33.1 against 21.3 ms),
and measured 1.15x the best hand plan (docs/results/search_and_memory.md). Since the
cpu profile's waits per group (2026-11-28) this case's search finds its own plan that fits,
and no longer reaches the kept-hand-plan branch: the first test holds the promises a user
gets either way, and the second reaches the branch by making the first compile report the
searched plan over the limit."""
import sys
from pathlib import Path

import jax
import pytest

import shardprop as sp
from tests.helpers import assert_trees_close

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_a_plan_over_the_limit_once_compiled_gives_way_to_one_no_worse_than_the_hands_that_fit():
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT / "examples"))
    import zoo
    c = next(c for c in zoo.limit_cases() + zoo.cases() if c.name == "gpt2_train_dp4xmp2")
    zoo.annotate.mode, zoo.annotate.mesh = "plain", c.mesh
    kw = dict(mesh=c.mesh, mode="auto", donate_argnums=c.state_argnums, progress=False, cost_model="cpu")
    free = sp.parallelize(c.fn, **kw).plan(*c.args())
    limit = int(0.9 * free.cost.peak_memory)
    pf = sp.parallelize(c.fn, memory_limit=limit, **kw)
    plan = pf.plan(*c.args())
    cost = plan.cost
    assert len(cost.memory_checks) > 1, "the case no longer needs the memory check's second round"
    assert cost.compiled_memory is not None and cost.compiled_memory.total <= limit
    under = [h.written for h in cost.hand_plans if h.written is not None and h.peak <= limit]
    assert under and cost.written_time <= min(under) * (1 + 1e-9), (cost.written_time, sorted(under))
    # (the plan kept was, with one wait for every group in the cpu profile, a hand plan that
    # fits once compiled, ``_hand_that_fits(below=)``; with the waits per group, 2026-11-28,
    # the search's own plan fits at this limit, or at 0.75-0.95, so this case no longer
    # reaches that branch: what is asserted is what a user is promised either way)
    got, want = pf(*c.args()), jax.jit(c.fn)(*c.args())
    assert_equal_to_one_device(got, want)


def assert_equal_to_one_device(got, want):
    """(params, Adam's state, loss) of one step against one device's: the loss to rounding,
    Adam's moments (the gradients, squared) to rounding, the parameters to one learning rate
    (1e-3): Adam divides a gradient by its root mean square, so a weight whose gradient is
    at rounding's size (1e-8, beside eps) moves by a part of the learning rate set by the
    rounding (the 2-layer GPT step's w1 at 0.9 of the free peak: 1.2e-4, its gradient
    1.5e-8 against 0.9e-8 on one device)."""
    params, state, loss = got
    params0, state0, loss0 = want
    assert_trees_close(loss, loss0, rtol=1e-5, atol=1e-6)
    assert_trees_close(state, state0, rtol=1e-4, atol=1e-7)
    assert_trees_close(params, params0, rtol=0, atol=1e-3)


@pytest.mark.slow
def test_a_hand_plan_cheaper_than_the_plan_of_a_lowered_limit_is_kept_where_it_fits_once_compiled(monkeypatch):
    """The kept-hand-plan branch, reached by making the first compile report the searched
    plan over the limit (XLA's own figure plus the limit in temp): the memory check lowers
    the modeled limit, whose plan is dearer than a hand plan compared with under the user's
    limit; that hand plan compiles under the limit, and it is what runs."""
    import dataclasses

    from shardprop.compiler import api
    sys.path.insert(0, str(ROOT / "tests"))
    from test_auto import compiled_bytes
    from test_auto_memory import adam_case
    fn, args = adam_case()
    kw = dict(mesh=((2, 4), ("dp", "mp")), mode="auto", progress=False, cost_model="cpu")
    limit = int(0.7 * sp.parallelize(fn, **kw).plan(*args).cost.peak_memory)
    real, calls = api._compiled_memory, []

    def first_over(c, a, k):
        used = real(c, a, k)
        calls.append(used)
        return dataclasses.replace(used, temp=used.temp + limit) if len(calls) == 1 else used
    monkeypatch.setattr(api, "_compiled_memory", first_over)
    pf = sp.parallelize(fn, memory_limit=limit, **kw)
    plan = pf.plan(*args)
    assert "this hand plan, cheaper as written, fits once compiled" in plan.cost.solver["status"]
    assert len(plan.cost.memory_checks) > 1
    monkeypatch.setattr(api, "_compiled_memory", real)
    assert compiled_bytes(pf, *args) <= limit
    assert_equal_to_one_device(pf(*args), jax.jit(fn)(*args))
