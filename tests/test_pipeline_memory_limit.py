"""``memory_limit`` reaches the strategy search of a pipelined step's sub-mesh (issue 26):
with ``mode="auto"`` on a mesh with a ``pp`` axis, the search that plans each stage's work
on the axes beside ``pp`` is held to what the pipeline leaves of the limit (the
accumulator and the micro-batches its schedule keeps in flight; other stages' state,
which the search counts and a device does not hold, given back), and the plan reports
the modeled peak per device that the limit holds (``PipelineInfo.device_peak``)."""
import re

import pytest

import shardprop as sp
from tests.test_pipeline_auto_mesh import assert_equals_one_device, mlp

MESH = ((4, 2), ("pp", "mp"))


def _parallelize(step, memory_limit=None, pipeline=sp.Pipeline(microbatches=4, schedule="1f1b")):
    return sp.parallelize(step, mesh=MESH, mode="auto", batch_argnums=(2, 3), memory_limit=memory_limit,
                          pipeline=pipeline)


def test_a_limit_the_free_plan_meets_keeps_it():
    """A limit above the free plan's modeled peak per device: the search runs once, free,
    and the plan reports the peak as its parts add up."""
    step, params, opt_state, data = mlp(stages=4)
    free = _parallelize(step).plan(params, opt_state, *data).pipeline
    info = _parallelize(step, memory_limit=int(free.device_peak) + 1).plan(params, opt_state, *data).pipeline
    assert info.submesh_budget is None and info.device_peak == free.device_peak
    assert info.device_peak == pytest.approx(info.submesh_peak - info.state_elsewhere + info.beyond_one_microbatch)
    assert 0 < info.state_elsewhere < info.submesh_peak and info.beyond_one_microbatch > 0


@pytest.mark.slow
def test_a_limit_the_free_plan_exceeds_splits_the_submesh_plan_to_fit():
    """Under 0.7 of the free plan's modeled peak per device, the sub-mesh search is held to a
    budget and splits state over mp (the free plan replicates it at this width); the
    modeled peak per device fits and the step still equals one device."""
    step, params, opt_state, data = mlp(stages=4)
    free = _parallelize(step).plan(params, opt_state, *data)
    limit = int(0.7 * free.pipeline.device_peak)
    pstep = _parallelize(step, memory_limit=limit)
    plan = pstep.plan(params, opt_state, *data)
    info = plan.pipeline
    assert info.submesh_budget is not None and info.submesh_peak <= info.submesh_budget
    assert info.device_peak <= limit < free.pipeline.device_peak
    assert info.device_peak == pytest.approx(info.submesh_peak - info.state_elsewhere + info.beyond_one_microbatch)
    assert any(any(dims) for dims in plan.program.sub.in_dims) and plan.program.sub.in_dims != \
        free.program.sub.in_dims
    assert "modeled peak per device" in info.text()
    assert_equals_one_device(step, params, opt_state, data, pstep, steps=2)


@pytest.mark.slow
def test_the_implied_pipeline_searches_its_cuts_under_the_limit():
    """mode="auto" on the pp mesh without pipeline= (no stage mark: the cuts, m and the
    schedule searched too): the same budget reaches the sub-mesh search."""
    step, params, opt_state, data = mlp(stages=0)
    free = _parallelize(step, pipeline=None).plan(params, opt_state, *data).pipeline
    limit = int(0.7 * free.device_peak)
    pstep = _parallelize(step, memory_limit=limit, pipeline=None)
    info = pstep.plan(params, opt_state, *data).pipeline
    assert info.submesh_budget is not None and info.device_peak <= limit
    assert_equals_one_device(step, params, opt_state, data, pstep, steps=2)


@pytest.mark.slow
def test_an_impossible_limit_names_the_limit_the_least_found_and_the_fix():
    step, params, opt_state, data = mlp(stages=4)
    with pytest.raises(sp.ShardingError, match=r"(?s)found no plan under memory_limit=10,000 bytes per device.*"
                                               r"the least it found is [\d,]+, at most [\d,]+ per device in the "
                                               r"pipeline \(the plan without a budget: [\d,]+\)\. Fix: raise "
                                               r"memory_limit to [\d,]+ or more.*largest tensors alive there: "
                                               r"params"):
        _parallelize(step, memory_limit=10_000).plan(params, opt_state, *data)


@pytest.mark.slow
def test_the_pipelines_own_count_is_tried_again_on_a_split_plan():
    """A limit under the pipeline's own count (its state row and slots) for every schedule
    with the free plan: the sub-mesh search is held to a budget all the same, and the
    pipeline's count, still over the limit, is given on that plan (fewer bytes than any
    candidate of the free plan)."""
    step, params, opt_state, data = mlp(stages=4)
    pipeline = sp.Pipeline(microbatches=4, schedule="auto")
    free = _parallelize(step, pipeline=pipeline).plan(params, opt_state, *data).pipeline
    least_free = min(row[3] for row in free.search)
    with pytest.raises(sp.ShardingError, match=r"no pipeline fits memory_limit=30000 bytes per device: the least, "
                                               r"(\d+) bytes") as err:
        _parallelize(step, memory_limit=30_000, pipeline=pipeline).plan(params, opt_state, *data)
    least = int(re.search(r"the least, (\d+) bytes", str(err.value)).group(1))
    assert 30_000 < least < least_free
