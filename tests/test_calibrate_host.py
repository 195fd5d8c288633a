"""What ``shardprop calibrate`` measures for the pipeline's host model (compiler/calibrate.py):
one device's compute rates alone beside all devices busy, how many devices' work the host
gets done with 1, 2, 4, ... busy, and a Python driver's cost per program and per transfer."""
import jax
import pytest

from shardprop.compiler import calibrate
from shardprop.passes.cost import CostModel


def test_rate_without_a_slope_is_the_largest_sample_outright():
    # noise that leaves every size the same time: no slope, so the largest sample's rate
    assert calibrate._rate([(1.0, 1.0), (2.0, 1.0), (4.0, 1.0)]) == 4.0
    # a clean slope past a fixed cost: the slope
    assert calibrate._rate([(1.0, 2.0), (2.0, 3.0), (4.0, 5.0)]) == pytest.approx(1.0)
    # the largest sample timed as nothing (a difference clamped at 0) is passed over
    assert calibrate._rate([(1.0, 1.0), (2.0, 1.0), (4.0, 0.0)]) == 2.0


def test_at_once_and_driver_costs_on_small_programs():
    devices = jax.devices()[:4]
    curve = calibrate._at_once(devices, reps=1, shape=(16, 16, 16))
    assert [k for k, _ in curve] == [1, 2, 4] and curve[0][1] == 1.0
    assert all(work > 0 for _, work in curve)
    dispatch, transfer = calibrate._driver_costs(devices, reps=1, calls=5)
    assert 0 < dispatch < 1 and 0 < transfer < 1


@pytest.mark.slow
def test_calibrate_measures_the_host_figures(tmp_path):
    model = calibrate.calibrate((2,), reps=1, sizes=(256,), kinds=("all_reduce",))
    assert model.alone is not None and model.alone.flops_per_s > 0 and model.alone.memory_bytes_per_s > 0
    assert [k for k, _ in model.at_once] == [1, 2] and model.dispatch_s > 0 and model.transfer_s > 0
    assert [k for k, _ in model.cores_alone] == ["contraction", "memory", "at_once"]
    assert all(0 < c <= 4 * calibrate.host_cores() for _, c in model.cores_alone)
    model.save(tmp_path / "p.json")
    assert CostModel.load(tmp_path / "p.json") == model


def test_a_kind_gets_its_own_fit_where_the_group_misses_it_one_way():
    pooled = calibrate.Link(10e-6, 5e9)
    sizes = (4096, 65536, 1 << 20)
    # reduce-scatter and all-gather on the 16-core host: 1.4-1.7x what the group's fit charges
    slower = [(b, 1.5 * pooled.time(b)) for b in sizes]
    assert calibrate._miss(pooled, slower) < calibrate.KIND_APART     # the old rule left it pooled
    assert calibrate._own_fit(pooled, slower)
    # noise of the same size, on both sides of the fit, stays pooled
    scattered = [(b, f * pooled.time(b)) for b, f in zip(sizes, (1.4, 0.7, 1.3))]
    assert calibrate._bias(pooled, scattered) == 0.0 and not calibrate._own_fit(pooled, scattered)
    # a small miss one way stays pooled too
    close = [(b, 1.1 * pooled.time(b)) for b in sizes]
    assert not calibrate._own_fit(pooled, close)


def test_cores_used_is_cpu_over_wall_on_a_small_program():
    """A jitted matmul chain on one device keeps at least some of a core busy and no more
    than the host's cores (CPU seconds of this process over wall seconds; the waiting
    Python thread adds a little)."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    jm = Mesh(np.array(jax.devices()[:1]), ("d",))
    x = jax.device_put(np.ones(128 * 128, np.float32), NamedSharding(jm, PartitionSpec("d")))
    used = calibrate._cores_used([(calibrate._program(jm, calibrate._matmul_body(128, 128, 128, 9)), x)], reps=3)
    assert 0.05 < used <= calibrate.host_cores() + 0.5


def test_at_once_layer_is_a_stage_forward_and_backward():
    """``at_once``'s program is a dense tanh layer's forward and backward, as a pipeline
    stage runs a micro-batch: one pass leaves the input's gradient (of the summed outputs),
    halved, where the input was, and keeps the buffer's shape."""
    import jax.numpy as jnp
    import numpy as np
    m, k, n = 4, 8, 8
    x = jnp.asarray(np.random.default_rng(0).standard_normal(max(m * k, k * n)).astype(np.float32)) * 0.3
    out = calibrate._layer_body(m, k, n, 1)(x)
    a, w = x[:m * k].reshape(m, k), x[:k * n].reshape(k, n)
    grad = jax.grad(lambda a: jnp.tanh(a @ w).sum())(a)
    assert out.shape == x.shape
    np.testing.assert_allclose(out[:m * k].reshape(m, k), 0.5 * grad, rtol=1e-4, atol=1e-5)
