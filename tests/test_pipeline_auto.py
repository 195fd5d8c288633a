"""A pipelined step's own search (issue 26, "Search"): without marks, the cuts, the
micro-batch count and the schedule are chosen together by ``search_pipeline``; stages
given per layer (``sp.Pipeline(stages=(n0, n1, ...))``). Each against one device."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardprop as sp
from tests.test_pipeline_lowering import assert_matches_one_device, gpt_pipeline_case, mlp


def _forward_ranges(plan):
    """Per model stage, how many forward ops it runs (the cuts' ranges)."""
    return [len(s.forward_ops) for s in plan.pipeline.stages]


@pytest.mark.slow
def test_joint_search_picks_cuts_m_and_schedule_and_lists_every_candidate():
    step, params, opt_state, batch = mlp(4, set())
    pstep = sp.parallelize(step, mesh=((2,), ("pp",)),
                           pipeline=sp.Pipeline(microbatches="auto", schedule="auto"))
    plan = pstep.plan(params, opt_state, batch)
    pl = plan.pipeline
    rows = pl.search
    fits = [r for r in rows if not r.reason]
    # the chosen configuration is the first row, and its cuts are the stages the plan runs
    assert (fits[0][1], fits[0][2]) == (pl.microbatches, pl.schedule_name)
    assert [b - a for a, b in fits[0].bounds] == _forward_ranges(plan)
    assert plan.program.an.cuts == fits[0].bounds
    # every micro-batch count of 2 rows or more and every flat schedule was priced
    assert {r[1] for r in fits} <= {1, 2, 4, 8} and {r[2] for r in fits if "simulated" in r.note} == \
        {"gpipe", "1f1b", "zero_bubble"}
    assert all(r.note for r in rows)


def test_memory_limit_rejects_with_reasons_and_the_choice_fits():
    step, params, opt_state, batch = mlp(4, set())
    mesh, pl = ((2,), ("pp",)), sp.Pipeline(microbatches="auto", schedule="auto")
    free = sp.parallelize(step, mesh=mesh, pipeline=pl).plan(params, opt_state, batch).pipeline.search
    priced = [r for r in free if not r.reason and "simulated" in r.note]
    limit = min(r[3] for r in priced)          # the leanest candidate's bytes: others cannot fit
    limited = sp.parallelize(step, mesh=mesh, pipeline=pl, memory_limit=limit)
    info = limited.plan(params, opt_state, batch).pipeline
    rows = info.search
    assert all(r[3] <= limit for r in rows if not r.reason)
    rejected = [r for r in rows if r.reason]
    assert rejected and all(r.reason.startswith("memory") and math.isinf(r[0]) for r in rejected)
    assert {r[2] for r in rejected} >= {"gpipe"}      # GPipe keeps every micro-batch's activations
    # the report's data: priced rows as before, the rejected ones apart with their reasons
    data = info.to_data()
    assert len(data["search_rejected"]) == len(rejected) and all(math.isfinite(r[0]) for r in data["search"])
    assert "Infinity" not in info.to_html()
    with pytest.raises(sp.ShardingError, match="no configuration fits memory_limit=100"):
        sp.parallelize(step, mesh=mesh, pipeline=pl, memory_limit=100).plan(params, opt_state, batch)


@pytest.mark.slow
def test_joint_search_equals_one_device():
    step, params, opt_state, batch = mlp(4, set())
    pstep = sp.parallelize(step, mesh=((2,), ("pp",)),
                           pipeline=sp.Pipeline(microbatches="auto", schedule="auto"))
    assert_matches_one_device(step, params, opt_state, (batch,), pstep, steps=3)


def test_no_marks_fixed_m_and_schedule_are_searched_cuts_only():
    step, params, opt_state, batch = mlp(4, set())
    pstep = sp.parallelize(step, mesh=((2,), ("pp",)), pipeline=sp.Pipeline(microbatches=4, schedule="gpipe"))
    pl = pstep.plan(params, opt_state, batch).pipeline
    assert (pl.microbatches, pl.schedule_name) == (4, "gpipe")
    assert {(r[1], r[2]) for r in pl.search if "simulated" in r.note} == {(4, "gpipe")}


def test_unequal_layers_auto_cuts_beat_equal_layer_cuts_on_the_cpu_profile():
    """Six light layers then two heavy ones on pp=4: the pipelined step's own search
    (no marks) against a stage_boundary every two layers, both modeled by the plan on the
    calibrated "cpu" profile (traced from shapes only)."""
    def make(cuts):
        def loss_fn(ws, x):
            h = x
            for i, (a, b) in enumerate(ws):
                h = h + jnp.tanh(h @ a) @ b
                if i in cuts:
                    h = sp.stage_boundary(h)
            return jnp.mean(h ** 2)

        def step(ws, x):
            loss, g = jax.value_and_grad(loss_fn)(ws, x)
            return [(a - 0.01 * ga, b - 0.01 * gb) for (a, b), (ga, gb) in zip(ws, g)], loss
        return step

    f32, width = jnp.float32, 256
    ws = [(jax.ShapeDtypeStruct((width, k), f32), jax.ShapeDtypeStruct((k, width), f32))
          for k in [width] * 6 + [8 * width] * 2]
    x = jax.ShapeDtypeStruct((128, width), f32)
    times = {}
    for name, cuts in (("equal", {1, 3, 5}), ("auto", set())):
        pstep = sp.parallelize(make(cuts), mesh=((4, 2), ("pp", "dp")), cost_model="cpu",
                               pipeline=sp.Pipeline(microbatches=8, schedule="1f1b"))
        times[name] = pstep.plan(ws, x).pipeline.step_time
    assert times["equal"] >= 1.3 * times["auto"], times


@pytest.mark.slow
def test_stages_per_layer_equal_one_device():
    step, params, opt_state, batch = mlp(6, set())
    pstep = sp.parallelize(step, mesh=((4,), ("pp",)),
                           pipeline=sp.Pipeline(microbatches="auto", schedule="auto", stages=(2, 1, 1, 2)))
    plan = pstep.plan(params, opt_state, batch)
    assert [s.forward_ops.count("tanh") for s in plan.pipeline.stages] == [2, 1, 1, 2]   # every layer once
    # the counts fix the cuts; m and the schedule were searched on them
    pl = plan.pipeline
    assert (pl.search[0][1], pl.search[0][2]) == (pl.microbatches, pl.schedule_name)
    assert_matches_one_device(step, params, opt_state, (batch,), pstep, steps=3)


@pytest.mark.slow
def test_stages_per_layer_on_a_gpt_equal_one_device():
    step, params, state, data = gpt_pipeline_case(3, 8, 1)          # no marks
    pstep = sp.parallelize(step, mesh=((2,), ("pp",)), batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=2, schedule="1f1b", stages=[2, 1]))
    pl = pstep.plan(params, state, *data).pipeline
    assert [s.forward_ops.count("tanh") for s in pl.stages] == [2, 1]     # one gelu per block
    assert_matches_one_device(step, params, state, data, pstep, steps=2)


def test_stages_per_layer_errors():
    step, params, opt_state, batch = mlp(4, set())
    mesh = ((2,), ("pp",))
    plan = lambda pl, s=step: sp.parallelize(s, mesh=mesh, pipeline=pl).plan(params, opt_state, batch)  # noqa: E731
    with pytest.raises(sp.ShardingError, match="the counts sum to 3, and the model has 4 layers"):
        plan(sp.Pipeline(microbatches=2, stages=(1, 2)))
    with pytest.raises(sp.ShardingError, match="3 layer counts for 2 model stages"):
        plan(sp.Pipeline(microbatches=2, stages=(1, 2, 1)))
    for bad in ((1, -1), "layers", (1.5, 2.5), ()):
        with pytest.raises(sp.ShardingError, match="the number of layers of each model stage"):
            sp.Pipeline(stages=bad)
    marked, *_ = mlp(4, {1})
    with pytest.raises(sp.ShardingError, match="by layer counts or by marks"):
        plan(sp.Pipeline(microbatches=2, stages=(2, 2)), marked)

    # layers of different shapes: nothing repeats, so there are no layers to count
    def loss_fn(ws, x):
        h = jnp.tanh(x @ ws[0])
        return jnp.mean(jnp.sin(h @ ws[1]) ** 2)

    def odd_step(ws, x):
        loss, g = jax.value_and_grad(loss_fn)(ws, x)
        return [w - 0.1 * gw for w, gw in zip(ws, g)], loss
    ws = [np.ones((8, 16), np.float32), np.ones((16, 4), np.float32)]
    with pytest.raises(sp.ShardingError, match="no op sequence repeats"):
        sp.parallelize(odd_step, mesh=mesh, pipeline=sp.Pipeline(microbatches=2, stages=(1, 1))).plan(
            ws, np.ones((8, 8), np.float32))


@pytest.mark.slow
def test_tensor_parallel_stages_per_layer_equal_one_device_and_joint_search_cuts_the_forward():
    """Beside mp (the step planned on the sub-mesh first): the per-rank program's backward
    is told from its forward (its collectives are linear), so layers and cuts are the
    forward's."""
    from jax.sharding import PartitionSpec as P
    opt = optax.adam(1e-2)

    def loss_fn(params, x, y):
        h = x
        for w1, w2 in params:
            h = jnp.tanh(sp.shard(jnp.matmul, (P(None, None), P(None, "mp")))(h, w1))
            h = h @ w2
        return jnp.mean((h - y) ** 2)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((8, 16)).astype(np.float32) * 0.3,
               rng.standard_normal((16, 8)).astype(np.float32) * 0.3) for _ in range(4)]
    x, y = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((16, 8)).astype(np.float32)
    mesh = ((2, 2), ("pp", "mp"))
    auto = sp.parallelize(step, mesh=mesh, batch_argnums=(2, 3),
                          pipeline=sp.Pipeline(microbatches="auto", schedule="auto"))
    counts = [s.forward_ops.count("tanh") for s in auto.plan(params, opt.init(params), x, y).pipeline.stages]
    assert sum(counts) == 4 and all(counts)          # the search's cuts split the forward's layers
    pstep = sp.parallelize(step, mesh=mesh, batch_argnums=(2, 3), pipeline=sp.Pipeline(microbatches=2, stages=(1, 3)))
    assert [s.forward_ops.count("tanh") for s in pstep.plan(params, opt.init(params), x, y).pipeline.stages] == [1, 3]
    assert_matches_one_device(step, params, opt.init(params), (x, y), pstep, steps=2)


@pytest.mark.slow
def test_forward_only_without_marks_and_per_layer_equal_one_device():
    k = jax.random.PRNGKey(1)
    ws = [jax.random.normal(jax.random.fold_in(k, i), (8, 8)) for i in range(4)]

    def infer(ws, x):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return h, jnp.sum(h)

    x = jax.random.normal(k, (16, 8))
    ref, rtotal = jax.jit(infer)(ws, x)
    for pl in (sp.Pipeline(microbatches="auto", schedule="auto"),
               sp.Pipeline(microbatches=4, schedule="gpipe", stages=(1, 1, 1, 1))):
        pinf = sp.parallelize(infer, mesh=((4,), ("pp",)), pipeline=pl)
        out, total = pinf(ws, x)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(total), np.asarray(rtotal), rtol=1e-5)
        info = pinf.plan(ws, x).pipeline
        assert info.schedule_name == "gpipe" and all(a.kind == "forward" for a in info.schedule.values())
        assert [s.forward_ops.count("tanh") for s in info.stages] == [1, 1, 1, 1]


@pytest.mark.slow
def test_joint_search_on_a_large_forward_cuts_in_windows():
    """A GPT of 8 blocks (hundreds of forward ops): the search prices at most 96 windows of
    the forward's time; its cuts land on forward op positions and cover every op once."""
    step, params, state, data = gpt_pipeline_case(8, 32, 1)
    pstep = sp.parallelize(step, mesh=((4,), ("pp",)), batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches="auto", schedule="auto"))
    plan = pstep.plan(params, state, *data)
    ops = _forward_ranges(plan)
    assert sum(ops) > 96 and all(ops)
    assert sum(s.forward_ops.count("tanh") for s in plan.pipeline.stages) == 8
    bounds = plan.pipeline.search[0].bounds
    assert bounds[0][0] == 0 and bounds[-1][1] == sum(ops) and [b - a for a, b in bounds] == ops
