"""mode="auto" on a mesh with a pipeline axis (issue 26): the step is pipelined over ``pp``
(the cuts without marks, the micro-batch count and the schedule searched by the pipeline
search) and each stage's work is planned on the axes beside ``pp`` by the strategy search
(``passes/auto``) instead of propagation from the user's marks; against one device."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardprop as sp
from shardprop.compiler.pipeline_step import PipelineFunction, unpack
from tests.test_pipeline_compose import tp_mlp

LR = 1e-3


def mlp(layers: int = 4, width: int = 16, batch: int = 16, stages: int = None):
    """An Adam step of (width -> 4 width -> width) pairs, no ``sp.shard`` mark; a stage mark
    after every ``layers // stages`` pairs (``stages`` None: after every pair but the
    last; 0: no mark). bench/pipeline_compose.py builds its cases with it too."""
    opt = optax.adam(LR)
    every = 1 if stages is None else (layers // stages if stages else 0)

    def loss_fn(params, x, y):
        h = x
        for i, (w1, w2) in enumerate(params):
            h = jnp.tanh(h @ w1) @ w2
            if every and (i + 1) % every == 0 and i < len(params) - 1:
                h = sp.stage_boundary(h)
        return jnp.mean((h - y) ** 2)

    def step(params, opt_state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        up, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, up), opt_state, loss

    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((width, 4 * width)).astype(np.float32) / np.sqrt(width),
               rng.standard_normal((4 * width, width)).astype(np.float32) / np.sqrt(4 * width))
              for _ in range(layers)]
    x = rng.standard_normal((batch, width)).astype(np.float32)
    y = rng.standard_normal((batch, width)).astype(np.float32)
    return step, params, opt.init(params), (x, y)


def assert_equals_one_device(step, params, opt_state, data, pstep, steps=5):
    """Issue 26's criterion: losses to rtol 1e-5 every step; after ``steps`` steps the
    parameters to half of Adam's learning rate (Adam divides a gradient by its
    own root mean square, so an element whose gradient is near zero turns a rounding
    difference of a tensor-parallel sum into a step of up to one learning rate) and the
    optimizer state as the pipeline tests hold it."""
    ref = jax.jit(step)
    p1, o1, p2, o2 = params, opt_state, params, opt_state
    for _ in range(steps):
        p1, o1, l1 = ref(p1, o1, *data)
        p2, o2, l2 = pstep(p2, o2, *data)
        np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(unpack(p2)), jax.tree.leaves(p1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=0.5 * LR, rtol=0)
    for a, b in zip(jax.tree.leaves(unpack(o2)), jax.tree.leaves(o1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


def test_auto_mode_on_a_pp_mesh_is_a_pipeline():
    """mode="auto" and a pp axis: a pipelined step whose micro-batch count and schedule are
    searched (and the cuts, without marks); a pp axis of one device is no pipeline; what a
    pipeline does not take is refused naming the mode and the mesh; an abstract mesh is
    sp.plan_step's."""
    step, params, opt_state, data = tp_mlp()
    pstep = sp.parallelize(step, mesh=((2, 2), ("pp", "mp")), mode="auto")
    assert isinstance(pstep, PipelineFunction)
    assert (pstep.pipeline.microbatches, pstep.pipeline.schedule, pstep.mode) == ("auto", "auto", "auto")
    assert pstep.planned                       # the axes beside pp are planned, by the search
    assert not isinstance(sp.parallelize(step, mesh=((1, 2), ("pp", "mp")), mode="auto"), PipelineFunction)
    with pytest.raises(sp.ShardingError, match=r"mode='auto' on a mesh with a 'pp' axis pipelines the step(.|\n)*"
                                               r"does not take donate_argnums yet"):
        sp.parallelize(step, mesh=((2, 2), ("pp", "mp")), mode="auto", donate_argnums=(0, 1))
    with pytest.raises(sp.ShardingError, match=r"more devices than the \d+ present(.|\n)*sp.plan_step"):
        sp.parallelize(step, mesh=((4, 4), ("pp", "mp")), mode="auto")


@pytest.mark.slow
def test_auto_with_a_pipeline_keeps_the_marks_pp4_mp2():
    """mode="auto" with pipeline=: the user's m and schedule, the stage marks' cuts, the
    sub-mesh step searched with the sp.shard marks kept (each first weight column-split
    over mp, so each rank holds (8, 8) halves of the (8, 16) weights)."""
    step, params, opt_state, data = tp_mlp(layers=4)
    pstep = sp.parallelize(step, mesh=((4, 2), ("pp", "mp")), mode="auto", batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=2, schedule="1f1b"))
    assert_equals_one_device(step, params, opt_state, data, pstep)
    plan = pstep.plan(params, opt_state, *data)
    assert (plan.pipeline.microbatches, plan.pipeline.schedule_name) == (2, "1f1b")
    assert all(plan.program.sub.in_dims[2 * i] == ((), ("mp",)) for i in range(4))


@pytest.mark.slow
def test_auto_without_shard_marks_plans_tensor_parallelism_pp4_mp2():
    """No sp.shard mark at all: the search plans each stage's tensor parallelism itself (at
    this width the default cost model splits a weight pair over mp, Megatron's way: the
    first by columns, the second by rows), and the pipeline search picks m and the
    schedule among every candidate."""
    step, params, opt_state, data = mlp(width=256)
    pstep = sp.parallelize(step, mesh=((4, 2), ("pp", "mp")), mode="auto", batch_argnums=(2, 3))
    assert_equals_one_device(step, params, opt_state, data, pstep, steps=3)
    plan = pstep.plan(params, opt_state, *data)
    dims = [plan.program.sub.in_dims[i] for i in range(2 * len(params))]
    assert ((), ("mp",)) in dims and (("mp",), ()) in dims, dims
    rows = plan.pipeline.search
    assert len({(r[1], r[2]) for r in rows}) > 1
    assert (plan.pipeline.microbatches, plan.pipeline.schedule_name) == rows[0][1:3]


@pytest.mark.slow
def test_auto_cuts_and_submesh_search_pp2_mp2():
    """Neither a stage mark nor a shard mark: the cuts, m and the schedule by the pipeline
    search, the stage programs by the strategy search."""
    step, params, opt_state, data = mlp(layers=4, stages=0)
    pstep = sp.parallelize(step, mesh=((2, 2), ("pp", "mp")), mode="auto", batch_argnums=(2, 3))
    assert_equals_one_device(step, params, opt_state, data, pstep, steps=3)
    plan = pstep.plan(params, opt_state, *data)
    assert plan.pipeline.search and plan.pipeline.search[0].bounds is not None
    assert len(plan.pipeline.stages) == 2 and all(s.forward_ops for s in plan.pipeline.stages)


@pytest.mark.slow
def test_auto_with_zero1_pp2_dp2_mp2_equals_one_device():
    """ZeRO-1 beside a searched sub-mesh. The search plans the micro-batch's step once and
    the whole batch's trace takes that plan (``pipeline_submesh.ReplaySearchedPlan``):
    searched apart, the two chose differently here (a slice of the rows over mp at one
    size only, 2026-11-27) and the pipeline stopped. Adam's moments split over dp on top
    of their weight's mp split."""
    step, params, opt_state, data = tp_mlp(layers=2)
    pstep = sp.parallelize(step, mesh=((2, 2, 2), ("pp", "dp", "mp")), mode="auto", batch_argnums=(2, 3),
                           shard_optimizer_state=True, pipeline=sp.Pipeline(microbatches=2, schedule="1f1b"))
    assert_equals_one_device(step, params, opt_state, data, pstep, steps=3)
    prog = pstep.plan(params, opt_state, *data).program
    n_params = len(jax.tree.leaves(params))
    moments = [sum(prog.sub.in_dims[n_params + i], ()) for i, leaf in enumerate(jax.tree.leaves(opt_state))
               if np.ndim(leaf) == 2]
    assert moments and all(set(axes) == {"dp", "mp"} for axes in moments), moments
