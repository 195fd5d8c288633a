"""Planning for devices that are not here (issue 28, milestone 1): an AbstractMesh or
(shape, names) larger than the devices plans from jax.ShapeDtypeStructs; running on it
is a clear error; the modeled memory per device matches a hand formula."""
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import shardprop as sp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

S = jax.ShapeDtypeStruct


def mlp(x, w1, w2):
    h = sp.shard(jnp.matmul, (P("dp", None), P(None, "mp")))(x, w1)
    return jnp.sum(jax.nn.relu(h) @ w2)


ARGS = (S((64, 128), jnp.float32), S((128, 512), jnp.float32), S((512, 128), jnp.float32))


def test_abstract_mesh_plans_from_shapes_and_refuses_to_run():
    pstep = sp.parallelize(mlp, mesh=AbstractMesh((16, 64), ("dp", "mp")))
    plan = pstep.plan(*ARGS)
    assert plan.mesh.size == 1024
    w1 = plan.graph.inputs[1]
    assert w1.local_type.shape == (128, 8)                  # columns split 64 ways
    assert plan.count("all_reduce") >= 1                     # the row-parallel matmul's partial sum
    with pytest.raises(sp.ShardingError, match=r"needs 1024 devices but jax sees 8"):
        pstep(*ARGS)
    with pytest.raises(sp.ShardingError, match=r"needs 1024 devices"):
        pstep.lower(*ARGS)


def test_named_shape_larger_than_devices_is_abstract():
    pstep = sp.parallelize(mlp, mesh=((4, 32), ("dp", "mp")))
    assert pstep.mesh_spec.abstract and pstep.plan(*ARGS).mesh.size == 128
    with pytest.raises(sp.ShardingError, match=r"needs 128 devices but jax sees 8"):
        pstep(*ARGS)


def test_bare_device_count_still_needs_the_devices():
    with pytest.raises(sp.ShardingError, match=r"needs 64 devices but jax sees 8.*name the axes"):
        sp.parallelize(mlp, mesh=64)


def test_abstract_plan_equals_the_plan_on_devices():
    """A mesh that is here, planned as abstract and as real: the same program."""
    real = sp.parallelize(mlp, mesh=((2, 4), ("dp", "mp"))).plan(*ARGS)
    abstract = sp.parallelize(mlp, mesh=AbstractMesh((2, 4), ("dp", "mp"))).plan(*ARGS)
    assert [str(c) for c in real.collectives] == [str(c) for c in abstract.collectives]
    assert [str(o) for o in real.ops] == [str(o) for o in abstract.ops]


def gpt_memory_formula(layers, e, vocab, seq, mp):
    """Per device, bytes of fp32 parameters under examples/gpt_megatron.py's marks: each
    layer's four e x e matmuls and two e x 4e ones split over mp (12 e^2 / mp), its four
    norm vectors whole, the embeddings and the final norm whole (the example does not
    split the vocabulary)."""
    return 4 * (layers * (12 * e * e // mp + 4 * e) + vocab * e + seq * e + 2 * e)


def _gpt_estimate(layers):
    from plan_scale import gpt_step
    step, args = gpt_step(layers)
    t0 = time.perf_counter()
    est = sp.plan_step(step, args, mesh=AbstractMesh((16, 64), ("dp", "mp")), cost_model=sp.Cluster(128, 8))
    return est, time.perf_counter() - t0


def _check_memory(est, layers):
    want = gpt_memory_formula(layers, 4096, 51200, 2048, 64)
    assert abs(est.param_bytes - want) / want < 0.02
    assert abs(est.grad_bytes - want) / want < 0.02
    # Adam: mu and nu like the parameters, plus its step count
    assert abs(est.optimizer_bytes - 2 * want) / (2 * want) < 0.02
    assert est.peak_bytes > est.param_bytes + est.optimizer_bytes


def test_gpt_memory_per_device_matches_hand_formula_2_layers():
    est, _ = _gpt_estimate(2)
    _check_memory(est, 2)


@pytest.mark.slow
def test_gpt12_plans_on_1024_abstract_devices_in_time():
    est, seconds = _gpt_estimate(12)
    _check_memory(est, 12)
    assert seconds <= 20, seconds


@pytest.mark.slow
def test_gpt12_auto_and_gpt48_plan_in_time():
    from plan_scale import gpt_step
    step, args = gpt_step(12, marks=False)
    t0 = time.perf_counter()
    sp.parallelize(step, mesh=AbstractMesh((16, 64), ("dp", "mp")), mode="auto", progress=False).plan(*args)
    assert time.perf_counter() - t0 <= 60
    est, seconds = _gpt_estimate(48)
    _check_memory(est, 48)
    assert seconds <= 60, seconds
