"""FSDP holds at most two layers' gathered weights: what XLA allocates for an FSDP
training step (``memory_analysis()``) is its state stored split, its activations
and no more than two layers of gathered weights (compiler/fsdp.py's ties keep
each gather at its use; docs/results/fsdp_memory.md has the figures)."""
from dataclasses import replace

import jax
import numpy as np
import pytest

import shardprop as sp
from bench.fsdp_memory import activation_bytes, case, config, layer_gathered_bytes
from tests.helpers import assert_trees_close

LAYERS = 6


@pytest.fixture(scope="module")
def fsdp_step():
    # sequence 8: a layer's weights (0.79 MB) outweigh its activations per device (0.16 MB),
    # so what gathering holds is the bulk of the step's memory
    pstep, args, dp, plain = case(LAYERS, "fsdp", config(LAYERS, seq=8))
    return pstep, args, dp, plain


@pytest.mark.slow
def test_fsdp_step_holds_at_most_two_layers_of_gathered_weights(fsdp_step):
    pstep, args, dp, plain = fsdp_step
    m = pstep.lower(*args).compile().memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    plain_plan = plain.plan(*args)
    layer = layer_gathered_bytes(plain_plan, plain_plan.mesh)      # one layer's weights, whole
    activations = activation_bytes(config(LAYERS, seq=8), dp)       # jax.vjp's residuals, batch split 8 ways
    params = sum(x.nbytes for x in jax.tree_util.tree_leaves(args[0]))
    # the arguments are the state stored split: a little over 1/8 of params and Adam's moments
    # (the batch, the step count, and norms too small to split are the rest)
    assert m.argument_size_in_bytes < 3 * params / 8 * 1.1
    # slack: one layer's weights more (a layer's gradients are whole before their reduce_scatter)
    slack = layer
    held = peak - m.argument_size_in_bytes - activations
    assert held <= 2 * layer + slack, (held, layer, m)
    assert LAYERS * layer > 2 * layer + slack    # every layer gathered at once would not fit


@pytest.mark.slow
def test_fsdp_step_with_ties_equals_one_device(fsdp_step):
    pstep, args, _, _ = fsdp_step
    fresh = jax.tree_util.tree_map(np.array, args)   # the step donates its state
    (p, state, loss) = pstep(*jax.tree_util.tree_map(np.array, args))
    (p0, state0, loss0) = jax.jit(pstep.fn)(*fresh)
    assert_trees_close(loss, loss0, rtol=1e-5, atol=1e-6)
    assert_trees_close(state, state0, rtol=1e-4, atol=1e-7)    # Adam's moments: the gradients
    # Adam moves a weight by up to the learning rate (1e-3) whatever its gradient's size: a
    # near-zero gradient's rounding can move it that much, so the params agree to that step
    assert_trees_close(p, p0, rtol=0, atol=1e-3)


def test_each_use_of_a_parameter_gathers_its_own_copy_after_a_tie():
    """The forward's and the backward's reads of a weight each get a tie and a gather:
    no gathered weight is shared between them (what let XLA keep it alive). A use whose
    strategy reads the weight as it is stored (wq's in the backward, split like it)
    reads the stored split itself, with no gather (before, it sliced the gathered copy)."""
    pstep, args, _, _ = case(1, "fsdp", replace(config(1), seq=8, heads=2, head_dim=4, vocab=16))
    plan = pstep.plan(*args)
    g = plan.graph
    readers = {}
    for op in g.ops:
        for v in op.inputs:
            readers.setdefault(v.id, []).append(op)
    ties = [op for op in g.ops if op.kind == "gather_tie"]
    wo = next(v for n, v in zip(g.input_names, g.inputs) if n == "params['layers'][0]['wo']")
    wo_ties = [op for op in ties if op.inputs[0] is wo]
    assert len(wo_ties) >= 2, "forward and backward each tie and gather wo"
    for tie in ties:
        (gather,) = readers[tie.outputs[0].id]
        assert gather.kind == "all_gather"
        assert len(readers[gather.outputs[0].id]) == 1, "a gathered copy serves one use"
    gathered = {op.outputs[0].id for op in g.ops if op.kind == "all_gather" and op.inputs[0] in g.inputs}
    assert not gathered, "every gather of a stored parameter starts from a tie"


def test_a_parameter_cast_to_bfloat16_is_gathered_at_each_use_as_in_float32():
    """Mixed precision (examples/gpt_plan.py casts each weight to bfloat16 where a layer
    starts, under jax.checkpoint): each use of the cast weight gathers it, so the step
    gathers as often as its float32 twin (the forward, the recomputed forward and the
    backward each their own), not once for all three."""
    from examples import gpt_plan as GP

    def gathers(dtype):
        cfg = GP.GPT(layers=2, hidden=32, heads=4, seq=8, vocab=64, batch=8, compute_dtype=dtype, dp="dp", mp=None)
        step, args = GP.train_step_and_args(cfg)
        pf = sp.parallelize(step, mesh=((8,), ("dp",)), shard_params=True, progress=False)
        return pf.plan(*args).counts()["all_gather"]
    assert gathers("bfloat16") == gathers("float32")


def test_gathers_of_uses_that_read_one_activation_run_one_after_the_other():
    """Three weights stored split and read by three matmuls of one activation (attention's
    query, key and value projections): XLA ran the three gathers as soon as the activation
    was there, the three gathered weights alive together (819 KB of scratch here); each
    gather's tie now also waits for the sibling use before it (runtime/lower.py
    ``_tie_waits``), and one gathered weight is alive at a time, as the model counts it."""
    def block(ws, x):
        wq, wk, wv = ws
        return jax.numpy.tanh(x @ wq) * jax.numpy.tanh(x @ wk) + x @ wv
    rng = np.random.default_rng(0)
    ws = tuple((rng.standard_normal((256, 256)) * 0.05).astype(np.float32) for _ in range(3))
    x = rng.standard_normal((64, 256)).astype(np.float32)
    f = sp.parallelize(block, mesh=8, mode="data_parallel", batch_argnums=(1,), shard_params=True,
                       param_argnums=(0,))
    np.testing.assert_allclose(f(ws, x), block(ws, x), rtol=1e-5, atol=1e-5)
    temp = f.lower(ws, x).compile().memory_analysis().temp_size_in_bytes
    one_gathered = 256 * 256 * 4
    assert temp < 1.5 * one_gathered
