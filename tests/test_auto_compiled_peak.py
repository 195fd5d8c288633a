"""A weight stored split and gathered at its uses holds one use's gathered copy at a
time once compiled, whoever chose that layout (``shard_params=True``, a mark, or the
search): insert-reshards gives each gathering use of a function argument its own
gather after a tie (``passes/insert_reshards.py`` ``TIE``), which the lowering writes as
a data dependence. Before, the forward's and the backward's uses shared one gather
and XLA ran every gather at the program's start: every layer's gathered weights
lived through the step (docs/results/fsdp_memory.md)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import shardprop as sp
from tests.helpers import assert_trees_close

LAYERS, WIDTH, BATCH = 6, 256, 64
MESH = ((8,), ("dp",))


def loss(ws, x):
    h = x
    for w in ws:
        # data parallel: each device computes its rows of the batch with the whole weight
        h = jnp.tanh(sp.shard(jnp.matmul, (P("dp", None), P()))(h, w))
    return jnp.mean(h ** 2)


def step(ws, x):
    value, grads = jax.value_and_grad(loss)(ws, x)
    return [w - 0.1 * g for w, g in zip(ws, grads)], value


def stored_split_step():
    """The weights stored split by rows over the 8 devices (``in_strategy``), each matmul
    marked to read its weight whole: a gather of every weight in the forward and one in
    the backward (dx = dy @ w.T), none of them FSDP's own."""
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32) for _ in range(LAYERS)]
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    pf = sp.parallelize(step, mesh=MESH, in_strategy=([P("dp", None)] * LAYERS, P("dp", None)), progress=False)
    return pf, (ws, x)


def test_a_marked_weight_stored_split_holds_one_gathered_copy_at_a_time():
    pf, args = stored_split_step()
    m = pf.lower(*args).compile().memory_analysis()
    layer = WIDTH * WIDTH * 4                       # one weight, whole
    # what the step holds beside its arguments and outputs: a layer's gathered weight, its
    # gradient whole before the reduce_scatter, and activations (8 KB a layer per device);
    # before, every layer's gathered weight at once (temp 1.57 MB = 6 layers)
    assert m.temp_size_in_bytes <= 3.5 * layer, (m.temp_size_in_bytes, layer)
    assert LAYERS * layer > 3.5 * layer


def test_each_use_of_a_marked_stored_weight_gathers_its_own_copy_after_a_tie():
    pf, args = stored_split_step()
    g = pf.plan(*args).graph
    readers = {}
    for op in g.ops:
        for v in op.inputs:
            readers.setdefault(v.id, []).append(op)
    ties = [op for op in g.ops if op.kind == "gather_tie"]
    # the forward's 6 reads and the backward's 5 (the first layer's dx is not needed)
    assert len(ties) == 2 * LAYERS - 1
    for tie in ties:
        assert tie.inputs[0] in g.inputs[:LAYERS]
        (gather,) = readers[tie.outputs[0].id]
        assert gather.kind == "all_gather"
        assert len(readers[gather.outputs[0].id]) == 1, "a gathered copy serves one use"


def test_a_stored_split_step_with_ties_equals_one_device():
    pf, args = stored_split_step()
    (ws, value) = pf(*args)
    (ws0, value0) = jax.jit(step)(*args)
    assert_trees_close(value, value0, rtol=1e-5, atol=1e-6)
    assert_trees_close(ws, ws0, rtol=1e-5, atol=1e-6)     # the update: the gradients, to rounding
