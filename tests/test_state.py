"""Training state: data-parallel mode, optimizer-state sharding (ZeRO-1) and
outputs tied to the inputs they replace, all derived from the graph."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardprop as sp
from tests.helpers import assert_trees_close

OPT = optax.adam(1e-2)


def net(p, x):
    return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"]


def step(p, st, batch):
    x, y = batch
    loss, g = jax.value_and_grad(lambda p: jnp.mean((net(p, x) - y) ** 2))(p)
    u, st = OPT.update(g, st, p)
    return optax.apply_updates(p, u), st, loss


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    p = {"w1": rng.normal(0, .1, (32, 64)).astype(np.float32), "b1": np.zeros(64, np.float32),
         "w2": rng.normal(0, .1, (64, 16)).astype(np.float32)}
    batch = (rng.random((32, 32), dtype=np.float32), rng.random((32, 16), dtype=np.float32))
    return p, OPT.init(p), batch


def run_steps(fn, p, st, batch, n=3):
    losses = []
    for _ in range(n):
        p, st, loss = fn(p, st, batch)
        losses.append(float(loss))
    return p, st, losses


@pytest.mark.slow
def test_data_parallel_mode_derives_gradient_all_reduce(setup):
    p, st, batch = setup
    pf = sp.parallelize(step, mesh=8, mode="data_parallel", verify=True)
    plan = pf.plan(p, st, batch)
    # one all_reduce per gradient (3 params) and one for the loss; nothing else
    assert plan.counts() == {"all_reduce": 4}
    g = plan.graph
    names = dict(zip(g.input_names, g.inputs))
    assert names["batch[0]"].layout.splits(plan.mesh) == (8, 1)
    assert names["p['w1']"].layout.is_replicated()
    got = run_steps(pf, p, st, batch)
    want = run_steps(jax.jit(step), p, st, batch)
    assert_trees_close(got, want)


@pytest.mark.slow
def test_optimizer_state_sharding_is_zero1(setup):
    p, st, batch = setup
    pf = sp.parallelize(step, mesh=8, mode="data_parallel", shard_optimizer_state=True, verify=True)
    plan = pf.plan(p, st, batch)
    counts = plan.counts()
    # gradients reduce-scattered, updated parameters all-gathered, once per parameter
    assert counts["reduce_scatter"] == 3 and counts["all_gather"] == 3
    assert counts.get("all_reduce", 0) == 1   # the loss
    g = plan.graph
    mu = [v for n, v in zip(g.input_names, g.inputs) if n.startswith("st[0].mu")]
    assert mu and all(v.layout.splits(plan.mesh)[0] == 8 for v in mu)
    for out_index, in_index in g.tied_outputs.items():
        assert g.outputs[out_index].layout == g.inputs[in_index].layout
    assert_trees_close(run_steps(pf, p, st, batch), run_steps(jax.jit(step), p, st, batch))


def test_donated_state_comes_back_in_its_layout(setup):
    p, st, batch = setup

    def shard_rows(p, st, batch):   # let the compiler choose: nothing pinned
        return step(p, st, batch)
    pf = sp.parallelize(shard_rows, mesh=8, donate_argnums=(0, 1))
    g = pf.plan(p, st, batch).graph
    assert len(g.tied_outputs) == len(jax.tree_util.tree_leaves((p, st)))
    for out_index, in_index in g.tied_outputs.items():
        assert g.outputs[out_index].layout == g.inputs[in_index].layout
    assert_trees_close(run_steps(pf, p, st, batch), run_steps(jax.jit(step), p, st, batch))


def test_data_parallel_batch_must_divide():
    p = {"w1": np.ones((32, 64), np.float32), "b1": np.zeros(64, np.float32), "w2": np.ones((64, 16), np.float32)}
    batch = (np.ones((12, 32), np.float32), np.ones((12, 16), np.float32))
    with pytest.raises(sp.ShardingError, match=r"splits batch input batch\[0\] on dim 0 over 8 devices, but its "
                                            r"shape is \(12, 32\)"):
        sp.parallelize(step, mesh=8, mode="data_parallel").plan(p, OPT.init(p), batch)
