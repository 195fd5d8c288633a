"""parallelize(pipeline=...)'s options that reach the plan: the cost model the cuts, the
search and the modeled step are priced by, and sp.report of a pipelined step's plan."""
import pytest

import shardprop as sp
from shardprop.passes.cost import CostModel
from tests.test_pipeline_lowering import mlp


def _plan(**kw):
    step, params, opt_state, batch = mlp(2, {0})
    # 8 devices: the calibrated cpu profile prices meshes of the 8 devices it was measured on
    pstep = sp.parallelize(step, mesh=((2, 4), ("pp", "dp")), pipeline=sp.Pipeline(microbatches=2, schedule="1f1b"),
                           **kw)
    return pstep.plan(params, opt_state, batch)


def test_cost_model_prices_the_pipeline_plan():
    default, cpu = _plan().pipeline, _plan(cost_model="cpu").pipeline
    named = _plan(cost_model=CostModel.builtin("cpu")).pipeline
    # the same stages, priced by the model given: the calibrated cpu profile is slower than the default model
    assert [s.ops for s in cpu.stages] == [s.ops for s in default.stages]
    assert cpu.stage_times == named.stage_times and cpu.step_time == pytest.approx(named.step_time)
    for k in range(len(cpu.stage_times)):
        assert cpu.stage_times[k]["forward"] > default.stage_times[k]["forward"]
    assert cpu.step_time > default.step_time


def test_a_cost_model_that_is_not_one_is_refused():
    with pytest.raises(sp.ShardingError, match="not a CostModel"):
        _plan(cost_model=3.5)


def test_sp_report_writes_a_pipeline_plans_page(tmp_path):
    path = tmp_path / "pipeline.html"
    sp.report(_plan(), path)
    page = path.read_text()
    assert "<html" in page.lower() and "model stages" in page and "F0" in page


def test_layers_widen_to_the_count_given_where_an_end_layer_differs():
    """``model_layers``' widening on tokens: blocks (1, 2, 3) where the first block's first
    op and the last block's last op have another token (same primitive): the exact run
    holds fewer blocks; four are found when four are asked for, at the blocks' phase."""
    from shardprop.compiler.pipeline_assign import _widen
    seq = [0, 9, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 8, 7]
    kinds = ["emb", "a", "b", "c", "a", "b", "c", "a", "b", "c", "a", "b", "c", "head"]
    assert _widen(seq, kinds, 4, 3, 2, 4) == (1, 3, 4)
    assert _widen(seq, kinds, 4, 3, 2, 5) is None          # no fifth block of the same primitives
    # a block whose primitives differ is not a layer, whatever the count asked for
    kinds[5] = "other"
    assert _widen(seq, kinds, 7, 3, 1, 3) is None


def _layered_mlp(widths):
    """An MLP written as a loop over layers whose first layer reads the input's own width
    (no embedding): its first matmul's shapes differ from the other layers'."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    opt = optax.sgd(0.05)

    def loss_fn(ws, x, y):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean((h - y) ** 2)

    def step(ws, opt_state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(ws, x, y)
        up, opt_state = opt.update(g, opt_state, ws)
        return optax.apply_updates(ws, up), opt_state, loss
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((a, b)) * 0.4).astype(np.float32) for a, b in zip(widths, widths[1:])]
    x = rng.standard_normal((8, widths[0])).astype(np.float32)
    y = rng.standard_normal((8, widths[-1])).astype(np.float32)
    return step, ws, opt.init(ws), (x, y)


@pytest.mark.slow
def test_layers_per_stage_where_the_first_layer_reads_another_width_equal_one_device():
    """Four layers, the first a (6, 8) matmul and the others (8, 8): the exact repeat is
    three layers, and ``stages=(2, 2)`` was refused ("the model has 3 layers"). The
    count given now widens the repeat over the first layer (``pipeline_assign._widen``)."""
    from tests.test_pipeline_lowering import assert_matches_one_device
    step, ws, opt_state, data = _layered_mlp([6, 8, 8, 8, 8])
    pstep = sp.parallelize(step, mesh=((2,), ("pp",)), batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=2, stages=(2, 2)))
    stages = pstep.plan(ws, opt_state, *data).pipeline.stages
    assert [s.forward_ops.count("tanh") for s in stages] == [2, 2]
    assert_matches_one_device(step, ws, opt_state, data, pstep, steps=2)
    with pytest.raises(sp.ShardingError, match="the model has 4 layers"):
        sp.parallelize(step, mesh=((2,), ("pp",)), batch_argnums=(2, 3),
                       pipeline=sp.Pipeline(microbatches=2, stages=(2, 3))).plan(ws, opt_state, *data)
