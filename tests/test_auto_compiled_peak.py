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


def searched_step(memory_limit=None):
    """mode="auto" on an SGD step whose arguments are stored split over the batch's axis
    (``in_strategy``): a batch of 64 against 256 x 256 weights, so the search computes
    data parallel and gathers each weight where a matmul reads it."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_auto import problem_data, sgd_step
    params, x, y = problem_data(BATCH, WIDTH, LAYERS)
    pf = sp.parallelize(sgd_step, mesh=MESH, mode="auto", donate_argnums=(0,), progress=False,
                        memory_limit=memory_limit, in_strategy=([P("dp", None)] * LAYERS, P("dp", None),
                                                                P("dp", None)))
    return pf, sgd_step, (params, x, y)


def weight_gathers(g) -> list:
    """The all_gathers of the weights (the first LAYERS arguments), each with what it reads."""
    made = {v.id: op for op in g.ops for v in op.outputs}
    out = []
    for op in g.ops:
        if op.kind != "all_gather":
            continue
        src = op.inputs[0]
        tie = made.get(src.id) if made.get(src.id) is not None and made[src.id].kind == "gather_tie" else None
        root = tie.inputs[0] if tie is not None else src
        if any(root is w for w in g.inputs[:LAYERS]):
            out.append((op, tie))
    return out


def test_a_searched_plan_storing_weights_split_gathers_each_at_its_use():
    pf, step_fn, args = searched_step()
    g = pf.plan(*args).graph
    gathers = weight_gathers(g)
    assert len(gathers) >= LAYERS - 1, "the search computes data parallel: it gathers the weights"
    assert all(tie is not None for _, tie in gathers), "every gather of a stored weight starts from its own tie"
    m = pf.lower(*args).compile().memory_analysis()
    layer = WIDTH * WIDTH * 4
    # before: 1.29 MB of temp (about every layer's weight gathered at once); now 0.66 MB
    assert m.temp_size_in_bytes <= 3 * layer, (m.temp_size_in_bytes, layer)
    (ws, value) = pf(*jax.tree_util.tree_map(np.array, args))
    (ws0, value0) = jax.jit(step_fn)(*jax.tree_util.tree_map(np.array, args))
    assert_trees_close(value, value0, rtol=1e-5, atol=1e-6)
    assert_trees_close(ws, ws0, rtol=1e-5, atol=1e-6)


def test_under_a_limit_the_searched_plan_that_gathers_at_use_fits_once_compiled_first_time():
    """1 MB per device: the search's first plan (weights gathered at use) models 0.96 MB and
    compiles to 0.84 MB, so the memory check keeps it. Before, the same plan compiled over the
    limit and the check searched 4 times (14 s) to end on a plan without weight gathers."""
    limit = 1_000_000
    pf, step_fn, args = searched_step(limit)
    plan = pf.plan(*args)
    assert len(plan.cost.memory_checks) == 1, plan.cost.memory_checks
    assert plan.cost.compiled_memory.total <= limit
    assert all(tie is not None for _, tie in weight_gathers(plan.graph))
    (ws, value) = pf(*jax.tree_util.tree_map(np.array, args))
    (ws0, value0) = jax.jit(step_fn)(*jax.tree_util.tree_map(np.array, args))
    assert_trees_close(value, value0, rtol=1e-5, atol=1e-6)
    assert_trees_close(ws, ws0, rtol=1e-5, atol=1e-6)
