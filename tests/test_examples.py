"""The examples a newcomer starts from run, and compute what one device computes."""
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import shardprop as sp
from tests.helpers import assert_trees_close

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import quickstart  # noqa: E402
import resnet  # noqa: E402


@pytest.mark.slow
def test_resnet_data_parallel_with_model_parallel_classifier():
    rng = np.random.default_rng(1)
    images = rng.standard_normal((16, 8, 8, 3)).astype(np.float32)
    labels = rng.integers(0, 16, (16,)).astype(np.int32)
    params = resnet.init_params()
    step, opt = resnet.make_train_step()
    pstep = sp.parallelize(step, mesh=8, donate_argnums=(0, 1))
    plan = pstep.plan(params, opt.init(params), images, labels)
    user = [o for o in plan.ops if o.origin == "user"]
    assert user[0].primitive == "conv_general_dilated" and user[0].in_strategy[0] == (8, 1, 1, 1)
    assert user[-1].primitive == "dot_general" and user[-1].in_strategy == ((1, 1), (1, 8))
    # the convolutions downstream follow the batch split without being told
    convs = [o for o in plan.ops if o.primitive == "conv_general_dilated" and o.origin != "user"]
    assert convs and all(o.in_strategy[0][0] == 8 for o in convs[:4])
    # MindSpore's hand-written plan: gather the pooled features once for the classifier,
    # reduce-scatter its input gradient back onto the batch; everything else stays
    # batch-split (no activation is all-reduced, gathered or cut back to the split)
    kinds = [c.kind for c in plan.collectives]
    assert kinds.count("all_gather") == 1 and kinds.count("reduce_scatter") == 1 and "slice" not in kinds
    scatter = next(c for c in plan.collectives if c.kind == "reduce_scatter")
    assert scatter.in_shape == (16, 8) and scatter.out_shape == (2, 8)
    assert not [c for c in plan.collectives if c.kind == "all_reduce" and c.in_shape[:1] == (16,)
                and len(c.in_shape) == 4]
    par, single = (params, opt.init(params)), (params, opt.init(params))
    for _ in range(3):
        *par, loss = pstep(*par, images, labels)
        *single, ref = jax.jit(step)(*single, images, labels)
        np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5, atol=1e-5)
    assert_trees_close(par, single, rtol=1e-4, atol=1e-5)


def test_quickstart_network_matches(tmp_path):
    x = np.random.default_rng(1).random((16, 32), dtype=np.float32)
    w1 = np.ones((32, 16), np.float32) * 0.1
    w2 = np.ones((16, 16), np.float32) * 0.1
    pf = sp.parallelize(quickstart.net, mesh=8, dump_dir=str(tmp_path))
    assert_trees_close(pf(x, w1, w2), jax.jit(quickstart.net)(x, w1, w2))
    assert (tmp_path / "rank_7" / "execute.ir").exists()
