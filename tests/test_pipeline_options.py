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
