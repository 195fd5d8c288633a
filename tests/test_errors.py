"""Bad input gets a clear error naming the operator, its source line, the shapes
and the strategy, and saying what to change. Checked by message, not just type."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardprop as sp

X, W1, W2 = np.ones((16, 32), np.float32), np.ones((32, 16), np.float32), np.ones((16, 16), np.float32)


def plan_with(in_strategy, out_strategy=None, mesh=8):
    def net(x, w1, w2):
        h = sp.shard(jnp.matmul, in_strategy, out_strategy)(x, w1)  # the line errors must name
        return jnp.matmul(jax.nn.relu(h), w2)
    line = net.__code__.co_firstlineno + 1
    with pytest.raises(sp.ShardingError) as info:
        sp.parallelize(net, mesh=mesh).plan(X, W1, W2)
    msg = str(info.value)
    assert f"test_errors.py:{line}" in msg, msg
    assert "shard(matmul)" in msg, msg
    assert "fix:" in msg, msg
    return msg


def test_split_does_not_divide_dim():
    msg = plan_with(((3, 4), (4, 1)))
    assert "splits dim 0 (size 16) into 3 parts" in msg
    assert "shapes:   ((16, 32), (32, 16))" in msg and "strategy: ((3, 4), (4, 1))" in msg
    assert "1, 2, 4, 8, 16" in msg


def test_contraction_splits_disagree():
    msg = plan_with(((2, 4), (2, 1)))
    assert "input 0 dim 1 (size 32) and input 1 dim 0 (size 32) are contracted together (dot_general)" in msg
    assert "split 4 and 2" in msg
    assert "e.g. ((2, 4), (4, 1))" in msg


def test_product_exceeds_devices():
    msg = plan_with(((4, 4), (4, 1)))
    assert "need 16 devices (4 x 4) but the mesh has 8" in msg


def test_split_product_not_dividing_device_count():
    def net(x, w1):
        return sp.shard(jnp.matmul, ((4, 1), (1, 1)))(x, w1)
    with pytest.raises(sp.ShardingError, match=r"multiply to 4, which does not divide the 6 devices"):
        sp.parallelize(net, mesh=6).plan(X, W1)


def test_wrong_number_of_inputs():
    msg = plan_with(((2, 4),))
    assert "in_strategy has 1 entries but the call has 2 array inputs" in msg
    assert "strategy: ((2, 4),)" in msg


def test_wrong_number_of_dims():
    msg = plan_with(((2, 4, 1), (4, 1)))
    assert "entry 0 has 3 split counts but that tensor has rank 2 (shape (16, 32))" in msg


@pytest.mark.parametrize("bad,what", [(2.0, "split count 2.0; split counts must be positive integers"),
                                      (0, "split count 0; split counts must be at least 1"),
                                      (-2, "split count -2; split counts must be at least 1")])
def test_bad_split_values(bad, what):
    msg = plan_with(((bad, 4), (4, 1)))
    assert what in msg and "shapes:" in msg


def test_unknown_mesh_axis():
    msg = plan_with((P("dp", "xx"), P("xx", None)), mesh=((2, 4), ("dp", "mp")))
    assert "names mesh axis 'xx', which the mesh does not have" in msg
    assert "use one of the mesh axes: dp, mp" in msg


def test_partition_spec_needs_named_mesh():
    msg = plan_with((P("dp", "mp"), P("mp", None)), mesh=8)
    assert "mesh axis 'dp'" in msg


def test_out_strategy_without_in_strategy():
    msg = plan_with(None, ((2, 1),))
    assert "out_strategy is given without an in_strategy" in msg


def test_contraction_axes_disagree_named():
    msg = plan_with((P("dp", "mp"), P("dp", None)), mesh=((2, 4), ("dp", "mp")))
    assert "contracted together (dot_general)" in msg and "('mp',)" in msg and "('dp',)" in msg


def test_primitive_without_rule_names_it_and_its_line():
    def f(x):
        return jax.lax.linalg.cholesky(x @ x.T + 32.0) * 2.0
    line = f.__code__.co_firstlineno + 1
    with pytest.raises(sp.ShardingError) as info:
        sp.parallelize(f, mesh=8).plan(X)
    msg = str(info.value)
    assert "primitive 'cholesky' has no sharding rule" in msg
    assert f"test_errors.py:{line}" in msg and "(16, 16)" in msg
    assert "register a rule" in msg


def test_mesh_larger_than_devices():
    with pytest.raises(sp.ShardingError, match=r"needs 64 devices but jax sees 8"):
        sp.parallelize(lambda x: x, mesh=64)


def test_parallelize_in_strategy_bad_split():
    with pytest.raises(sp.ShardingError, match=re.escape("splits dim 1 (size 32) into 3 parts")):
        sp.parallelize(lambda x: x * 2, mesh=8, in_strategy=((1, 3),)).plan(X)


def test_unknown_mode():
    with pytest.raises(sp.ShardingError, match="mode='auto_magic'"):
        sp.parallelize(lambda x: x, mesh=8, mode="auto_magic")
