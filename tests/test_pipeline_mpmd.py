"""``sp.Pipeline(..., lowering="mpmd")`` (runtime/pipeline_mpmd.py): one jitted program per
stage action on its rank's device, driven from Python along the schedule's tick table.
Each case against one device, and the driver's transfers and per-rank state."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardprop as sp
from jax.sharding import PartitionSpec as P

from tests.test_pipeline_compose import tp_mlp
from tests.test_pipeline_lowering import (B, D, assert_matches_one_device, even_cuts, forward_only_case,
                                         gpt_pipeline_case, mlp, tied_and_clipped)


def mpmd(p, **kw):
    kw.setdefault("microbatches", 4)
    return dict(mesh=((p,), ("pp",)), pipeline=sp.Pipeline(lowering="mpmd", **kw))


def neighbours(transfers, p, wrap=False):
    ok = {(d, d + 1) for d in range(p - 1)} | {(d + 1, d) for d in range(p - 1)}
    if wrap:
        ok |= {(p - 1, 0), (0, p - 1)}
    return all((a, b) in ok for a, b, _ in transfers)


@pytest.mark.slow
def test_mpmd_pp2_1f1b_equals_one_device_and_sends_only_to_neighbours():
    step, params, opt_state, batch = mlp(2, {0})
    pstep = sp.parallelize(step, **mpmd(2, schedule="1f1b"))
    p2, o2 = assert_matches_one_device(step, params, opt_state, (batch,), pstep)
    mp = pstep.mpmd(params, opt_state, batch)
    # one activation forward and one cotangent back per micro-batch, nothing else in the tick loop
    assert sorted(mp.transfers) == sorted([(0, 1, "activation")] * 4 + [(1, 0, "cotangent")] * 4)
    # the state comes back as plain arrays on its stage's device, read in place by the next step
    assert p2[1]["w"].devices() == {mp.devices[1]} and p2[0]["w"].devices() == {mp.devices[0]}
    pstep(p2, o2, batch)
    # no parameter moves: only Adam's step count (a scalar computed from the inputs alone, on
    # the first device, as the SPMD lowering computes it) and the batch rows rank 1 reads
    assert [t for t in mp.input_transfers if t[2] == "input"] == [(0, 1, "input", ())]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,p,v", [("gpipe", 4, 1), ("1f1b", 4, 1), ("zero_bubble", 4, 1),
                                          ("interleaved", 4, 2), ("1f1b", 8, 1)])
def test_mpmd_schedules_equal_one_device(schedule, p, v):
    step, params, opt_state, batch = mlp(p * v, even_cuts(p * v, p * v))      # one layer per model stage
    pstep = sp.parallelize(step, **mpmd(p, microbatches=4 if v == 1 else p, schedule=schedule, virtual_stages=v))
    assert_matches_one_device(step, params, opt_state, (batch,), pstep)
    mp = pstep.mpmd(params, opt_state, batch)
    m = 4 if v == 1 else p
    # every cut is crossed once forward and once backward per micro-batch, between neighbours only
    assert len(mp.transfers) == 2 * (p * v - 1) * m
    assert neighbours(mp.transfers, p, wrap=v > 1)
    assert mp.once_transfers == []
    # one program per action of the tick table: nothing runs on a bubble
    assert mp.actions_dispatched == len(mp.prog.sim.tick_table)


@pytest.mark.slow
def test_mpmd_rank_holds_its_stages_state_unpadded():
    """Stages of 3 layers and 1 layer: each rank holds its own layers' parameters and Adam
    moments at their shapes; the SPMD lowering pads every rank's row to the largest stage."""
    step, params, opt_state, batch = mlp(4, {2})
    pstep = sp.parallelize(step, **mpmd(2, schedule="1f1b"))
    p2, o2, _ = pstep(params, opt_state, batch)
    mp = pstep.mpmd(params, opt_state, batch)
    mu, nu = o2[0].mu, o2[0].nu
    layer_bytes = lambda i: sum(x.nbytes for t in (p2, mu, nu) for x in jax.tree.leaves(t[i]))  # noqa: E731
    for d, layers in ((0, (0, 1, 2)), (1, (3,))):
        for i in layers:
            assert all(x.devices() == {mp.devices[d]} for t in (p2, mu, nu) for x in jax.tree.leaves(t[i]))
        held = sum(x.nbytes for x in jax.tree.leaves((p2, o2)) if x.devices() == {mp.devices[d]}
                   and x.ndim > 0)
        assert held == sum(layer_bytes(i) for i in layers)
    # the driver's account of the inputs it stores per rank agrees (plus Adam's scalar step count)
    per_rank = mp.param_bytes()
    assert per_rank == [sum(layer_bytes(i) for i in (0, 1, 2)) + 4, layer_bytes(3) + 4]
    spmd = sp.parallelize(step, mesh=((2,), ("pp",)), pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
    padded = spmd.plan(params, opt_state, batch).program.state_size * 4
    assert padded > per_rank[1]


@pytest.mark.slow
def test_mpmd_1f1b_holds_fewer_activations_than_gpipe():
    """The driver drops each value after its last reader: 1F1B's ranks hold about p - d
    micro-batches' activations at once, GPipe's all m."""
    step, params, opt_state, batch = mlp(4, even_cuts(4, 4))
    peak = {}
    for schedule in ("gpipe", "1f1b"):
        pstep = sp.parallelize(step, **mpmd(4, microbatches=8, schedule=schedule))
        peak[schedule] = pstep.mpmd(params, opt_state, batch).peak_activation_bytes
    assert all(o < g for o, g in zip(peak["1f1b"], peak["gpipe"]))
    assert max(peak["1f1b"]) <= 0.6 * max(peak["gpipe"])


def test_mpmd_forward_only():
    infer, ws, x = forward_only_case()
    pinf = sp.parallelize(infer, **mpmd(4, schedule="gpipe"))
    out, total = pinf(ws, x)
    ref, rtotal = jax.jit(infer)(ws, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(total), np.asarray(rtotal), rtol=1e-5)
    mp = pinf.mpmd(ws, x)
    assert sorted(mp.transfers) == sorted([(d, d + 1, "activation") for d in range(3)] * 4)


@pytest.mark.slow
def test_mpmd_tied_embedding_gpt_pp4_equals_one_device():
    """The tied embedding's two gradients are summed between its owner stages only (ranks 0
    and 3); its new value and Adam moments come back there and stay for the next step."""
    step, params, state, data = gpt_pipeline_case(4, 8, 4, tied=True)
    pstep = sp.parallelize(step, batch_argnums=(2, 3), **mpmd(4, schedule="1f1b"))
    p2, s2 = assert_matches_one_device(step, params, state, data, pstep)
    mp = pstep.mpmd(params, state, *data)
    assert neighbours(mp.transfers, 4)
    assert mp.once_transfers and {(a, b) for a, b, _ in mp.once_transfers} <= {(0, 3), (3, 0)}
    assert all(t[3] == () for t in mp.input_transfers if t[2] == "input")


@pytest.mark.slow
def test_mpmd_global_norm_clipping_and_a_shared_weight_equal_one_device():
    """Once ops that combine stages (a weight used by the first and the last stage, a
    global gradient norm) in the plan's phases, on the ranks that need them."""
    step, w, o, x = tied_and_clipped()
    pstep = sp.parallelize(step, **mpmd(3))
    assert_matches_one_device(step, w, o, (x,), pstep)


@pytest.mark.slow
def test_mpmd_pp4_by_dp2_equals_one_device():
    """Data parallel inside each stage: a stage's programs run on its dp group, each device
    on its rows of the micro-batch; the partial sums are summed over dp once, before the
    update, and the state stays replicated on the group."""
    step, params, opt_state, batch = mlp(4, {0, 1, 2})
    pstep = sp.parallelize(step, mesh=((4, 2), ("pp", "dp")), pipeline=sp.Pipeline(microbatches=4,
                                                                                    lowering="mpmd"))
    p2, o2 = assert_matches_one_device(step, params, opt_state, (batch,), pstep)
    mp = pstep.mpmd(params, opt_state, batch)
    assert mp.dp == 2 and neighbours(mp.transfers, 4) and len(mp.transfers) == 2 * 3 * 4
    assert p2[3]["w"].devices() == mp.groups[3]


@pytest.mark.slow
def test_mpmd_forward_only_pp2_by_dp2():
    ws = [jnp.full((D, D), 0.1 * (i + 1)) for i in range(2)]

    def infer(ws, x):
        h = sp.stage_boundary(jnp.tanh(x @ ws[0]))
        return jnp.tanh(h @ ws[1]) * 2, jnp.sum(h)

    x = jax.random.normal(jax.random.PRNGKey(0), (B, D))
    pinf = sp.parallelize(infer, mesh=((2, 2), ("pp", "dp")),
                          pipeline=sp.Pipeline(microbatches=4, schedule="gpipe", lowering="mpmd"))
    for got, want in zip(pinf(ws, x), jax.jit(infer)(ws, x)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_mpmd_tensor_parallel_mlp_pp2_mp2_equals_one_device():
    """Tensor parallel inside each stage: the per-rank program planned on the mp axis,
    each action a shard_map over the rank's pair of devices with the plan's collectives;
    each weight comes back split over mp on its stage's pair."""
    step, params, opt_state, data = tp_mlp()
    pstep = sp.parallelize(step, mesh=((2, 2), ("pp", "mp")), batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=2, schedule="1f1b", lowering="mpmd"))
    p2, _ = assert_matches_one_device(step, params, opt_state, data, pstep)
    mp = pstep.mpmd(params, opt_state, *data)
    assert p2[1][0].devices() == mp.groups[1] and p2[1][0].sharding.spec == P(None, "mp")
    assert neighbours(mp.transfers, 2) and mp.once_transfers == []


@pytest.mark.slow
def test_mpmd_pp2_dp2_zero1_equals_one_device():
    """ZeRO-1 over dp inside each stage (the step planned on the dp axis): Adam's moments
    come back split over dp on their stage's pair of devices."""
    step, params, opt_state, batch = mlp(2, {0})
    pstep = sp.parallelize(step, mesh=((2, 2), ("pp", "dp")), shard_optimizer_state=True,
                           pipeline=sp.Pipeline(microbatches=2, schedule="1f1b", lowering="mpmd"))
    p2, o2 = assert_matches_one_device(step, params, opt_state, (batch,), pstep)
    mp = pstep.mpmd(params, opt_state, batch)
    for d in range(2):
        for x in jax.tree.leaves((o2[0].mu[d], o2[0].nu[d])):
            assert x.sharding.spec == P("dp") and x.devices() == mp.groups[d]


@pytest.mark.slow
def test_mpmd_fewer_microbatches_than_stages_and_automatic_cuts_equal_one_device():
    step, params, opt_state, batch = mlp(4, {0, 1, 2})
    pstep = sp.parallelize(step, **mpmd(4, microbatches=2, schedule="1f1b"))
    assert_matches_one_device(step, params, opt_state, (batch,), pstep, steps=3)
    step, params, opt_state, batch = mlp(4, set())                 # no marks: the search cuts
    pstep = sp.parallelize(step, **mpmd(2, microbatches="auto", schedule="auto"))
    assert_matches_one_device(step, params, opt_state, (batch,), pstep, steps=3)


def test_mpmd_refuses_unknown_lowerings():
    with pytest.raises(sp.ShardingError, match=r"lowering='mimd'.*'spmd', 'mpmd'"):
        sp.Pipeline(lowering="mimd")


def tp_forward(cuts):
    """A forward of Megatron MLP pairs (column marks over mp) returning its per-example
    output and a sum: (infer, weights, x)."""
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((8, 16)).astype(np.float32) * .3, rng.standard_normal((16, 8)).astype(np.float32) * .3)
          for _ in range(4)]

    def infer(ws, x):
        h = x
        for i, (a, b) in enumerate(ws):
            h = jnp.tanh(sp.shard(jnp.matmul, (P(None, None), P(None, "mp")))(h, a)) @ b
            if i in cuts:
                h = sp.stage_boundary(h)
        return h, jnp.sum(h ** 2)
    return infer, ws, rng.standard_normal((16, 8)).astype(np.float32)


@pytest.mark.parametrize("lowering", ["spmd", "mpmd"])
@pytest.mark.parametrize("mesh,cuts", [(((4, 2), ("pp", "mp")), {0, 1, 2}), (((2, 2, 2), ("pp", "dp", "mp")), {1})])
def test_forward_beside_tensor_parallel_returns_per_example_outputs(mesh, cuts, lowering):
    """Inference of a tensor-parallel model over pipeline stages: each micro-batch's output
    comes off its rank's sub-mesh under its planned layout (MPMD: its stacked values; SPMD:
    each device's blocks in the step's output buffer) and the micro-batches are joined in
    order. Both lowerings refused it before."""
    infer, ws, x = tp_forward(cuts)
    want, want_sum = jax.jit(infer)(ws, x)
    f = sp.parallelize(infer, mesh=mesh, batch_argnums=(1,),
                       pipeline=sp.Pipeline(microbatches=4, schedule="gpipe", lowering=lowering))
    got, got_sum = f(ws, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(got_sum), float(want_sum), rtol=1e-5)
