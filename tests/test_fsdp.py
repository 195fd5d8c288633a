"""FSDP / ZeRO-3 as a hand plan (``shard_params=True``): parameters and optimizer state
stored split over the data-parallel devices, each weight gathered at use, gradients
reduce-scattered; equal to one device step by step."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardprop as sp
from examples.gpt_megatron import Config, Parallelism, init_params, make_batch, make_train_step
from tests.helpers import assert_trees_close

OPT = optax.adam(1e-2)


def net(p, x):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    return h @ p["w2"] + p["b2"]


def step(p, st, batch):
    x, y = batch
    loss, g = jax.value_and_grad(lambda p: jnp.mean((net(p, x) - y) ** 2))(p)
    u, st = OPT.update(g, st, p)
    return optax.apply_updates(p, u), st, loss


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    p = {"w1": rng.normal(0, .1, (32, 64)).astype(np.float32), "b1": np.zeros(64, np.float32),
         "w2": rng.normal(0, .1, (64, 16)).astype(np.float32), "b2": np.zeros(16, np.float32)}
    batch = (rng.random((32, 32), dtype=np.float32), rng.random((32, 16), dtype=np.float32))
    return p, OPT.init(p), batch


def run_steps(fn, p, st, data: tuple, n=5):
    """n steps of fn(p, st, *data): the final params and state, and every loss."""
    losses = []
    for _ in range(n):
        p, st, loss = fn(p, st, *data)
        losses.append(float(loss))
    return (p, st), losses


def stored(plan, prefix):
    g = plan.graph
    return {n: v for n, v in zip(g.input_names, g.inputs) if n.startswith(prefix)}


@pytest.mark.slow
def test_fsdp_data_parallel_gathers_each_weight_and_reduce_scatters_its_gradient(setup):
    p, st, batch = setup
    pf = sp.parallelize(step, mesh=8, mode="data_parallel", shard_params=True, verify=True, progress=False)
    plan = pf.plan(p, st, batch)
    mesh = plan.mesh
    params = stored(plan, "p[")
    assert len(params) == 4
    # every parameter and Adam moment is stored split 8 ways: 1/8 of its bytes per device
    for v in list(params.values()) + list(stored(plan, "st[0].mu").values()) + list(stored(plan, "st[0].nu").values()):
        assert np.prod(v.layout.local_shape(v.type.shape, mesh)) * 8 == np.prod(v.type.shape), (v, v.layout)
    counts = plan.counts()
    # one gather per use (forward and backward each gather their own copy: w2 twice, as
    # the backward's dh = dy @ w2.T reads it too), one reduce_scatter per gradient, and no
    # all_reduce but the loss's
    assert counts["all_gather"] == 5 and counts["reduce_scatter"] == 4, counts
    assert counts.get("all_reduce", 0) == 1, counts
    gathered = sorted(c.out_shape for c in plan.collectives if c.kind == "all_gather")
    assert gathered == sorted([v.type.shape for v in params.values()] + [params["p['w2']"].type.shape])
    for out_index, in_index in plan.graph.tied_outputs.items():   # state comes back as it is stored
        assert plan.graph.outputs[out_index].layout == plan.graph.inputs[in_index].layout
    got, want = run_steps(pf, p, st, (batch,)), run_steps(jax.jit(step), p, st, (batch,))
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fsdp_composes_with_megatron_marks_on_a_named_mesh():
    cfg = Config(layers=2)
    params = init_params(cfg)
    tokens, targets = make_batch(cfg)
    train_step, opt = make_train_step(Parallelism.data_and_tensor(), cfg)
    state = opt.init(params)
    mesh = ((2, 4), ("dp", "mp"))
    tp = sp.parallelize(train_step, mesh=mesh, progress=False).plan(params, state, tokens, targets)
    pf = sp.parallelize(train_step, mesh=mesh, shard_params=True, verify=True, progress=False)
    plan = pf.plan(params, state, tokens, targets)
    tp_layouts = {n: v.layout for n, v in zip(tp.graph.input_names, tp.graph.inputs)}
    for name, v in stored(plan, "params").items():
        # stored: the tensor-parallel layout with dp added, half its bytes per device
        planned = tp_layouts[name]
        assert "dp" in v.layout.used_axes() and planned.used_axes() <= v.layout.used_axes(), (name, v.layout)
        assert np.prod(v.layout.local_shape(v.type.shape, plan.mesh)) * 2 == \
            np.prod(planned.local_shape(v.type.shape, plan.mesh)), (name, v.layout, planned)
    # each weight is gathered from its stored split to its tensor-parallel layout, over dp groups
    dp_groups = {(0, 4), (1, 5), (2, 6), (3, 7)}
    gathers = {(c.in_shape, c.out_shape) for c in plan.collectives
               if c.kind == "all_gather" and set(c.groups) == dp_groups}
    for name, v in stored(plan, "params").items():
        shapes = (v.layout.local_shape(v.type.shape, plan.mesh), tp_layouts[name].local_shape(v.type.shape, plan.mesh))
        assert shapes in gathers, (name, shapes)
    got = run_steps(pf, params, state, (tokens, targets))
    want = run_steps(jax.jit(train_step), params, state, (tokens, targets))
    assert_trees_close(got[1], want[1], rtol=1e-5, atol=1e-6)          # losses
    assert_trees_close(got[0], want[0], rtol=1e-4, atol=1e-5)          # params and Adam state


def test_fsdp_leaves_what_no_dim_can_split_as_planned():
    """A scalar (Adam's step count) and a size-3 bias cannot be split 8 ways: they stay
    as planned, and the step is still one device's."""
    rng = np.random.default_rng(1)
    p = {"w": rng.normal(0, .1, (16, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}
    st = OPT.init(p)
    batch = (rng.random((16, 16), dtype=np.float32), rng.random((16, 3), dtype=np.float32))

    def small_step(p, st, batch):
        x, y = batch
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))(p)
        u, st = OPT.update(g, st, p)
        return optax.apply_updates(p, u), st, loss
    pf = sp.parallelize(small_step, mesh=8, mode="data_parallel", shard_params=True, progress=False)
    plan = pf.plan(p, st, batch)
    assert stored(plan, "p['b']")["p['b']"].layout.is_replicated()
    assert not stored(plan, "p['w']")["p['w']"].layout.is_replicated()
    assert_trees_close(run_steps(pf, p, st, (batch,)), run_steps(jax.jit(small_step), p, st, (batch,)),
                       rtol=1e-5, atol=1e-6)
