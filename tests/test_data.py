"""Input pipelines: each process takes its share of the same global batches,
reshuffled per epoch, assembled into global arrays laid out as the step wants."""
import jax
import numpy as np
import pytest

import shardprop as sp


def test_shares_cover_each_global_batch_exactly():
    samplers = [sp.DistributedSampler(64, 16, num_replicas=4, rank=r, seed=7) for r in range(4)]
    for s in samplers:
        s.set_epoch(2)
    shares = [list(s) for s in samplers]
    globals_ = list(samplers[0].global_batches())
    for b, batch in enumerate(globals_):
        assert np.array_equal(np.concatenate([shares[r][b] for r in range(4)]), batch)
    assert sorted(np.concatenate(globals_)) == list(range(64))


def test_same_global_batches_whatever_the_process_count():
    one = sp.DistributedSampler(64, 16, num_replicas=1, rank=0, seed=7)
    two = [sp.DistributedSampler(64, 16, num_replicas=2, rank=r, seed=7) for r in range(2)]
    for b, batch in enumerate(one):
        assert np.array_equal(np.concatenate([list(s)[b] for s in two]), batch)


def test_reshuffled_per_epoch_and_reproducible():
    s = sp.DistributedSampler(64, 16, num_replicas=1, rank=0, seed=7)
    s.set_epoch(0)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    s.set_epoch(0)
    assert not np.array_equal(np.concatenate(e0), np.concatenate(e1))
    assert all(np.array_equal(a, b) for a, b in zip(e0, list(s)))


def test_uneven_global_batch_is_an_error():
    with pytest.raises(ValueError, match="does not divide over 3 processes"):
        sp.DistributedSampler(60, 16, num_replicas=3, rank=0)


def test_loader_assembles_global_arrays_in_the_steps_layout():
    x = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    y = np.arange(64, dtype=np.int32)
    step = sp.parallelize(lambda a, b: (a * 2.0).sum() + b.sum(), mesh=8, mode="data_parallel", batch_argnums=(0, 1))
    shardings = step.input_shardings(x[:16], y[:16])
    loader = sp.DataLoader([x, y], sp.DistributedSampler(64, 16, num_replicas=1, rank=0, seed=3), shardings)
    batches = list(loader)
    assert len(batches) == 4
    order = list(loader.sampler.global_batches())
    for (bx, by), idx in zip(batches, order):
        assert bx.sharding == shardings[0] and by.sharding == shardings[1]
        np.testing.assert_array_equal(np.asarray(bx), x[idx])
        np.testing.assert_array_equal(np.asarray(by), y[idx])
        np.testing.assert_allclose(float(step(bx, by)), float((x[idx] * 2).sum() + y[idx].sum()), rtol=1e-6)
    assert jax.process_count() == 1
