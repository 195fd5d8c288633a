"""Propagation memoizes each settling choice per situation, so repeated layers are
worked out once. The memo must be invisible: the same plan, op for op, as working
every choice out afresh."""
import sys
from pathlib import Path

import numpy as np
import pytest

import shardprop as sp
from shardprop.passes.bind_strategies import BindUserStrategies
from shardprop.passes.propagate import PropagateSharding

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt_megatron as M  # noqa: E402
import resnet  # noqa: E402

CFG = M.Config(layers=3)


def _gpt(par, mesh, donate=()):
    params = M.init_params(CFG)
    tokens, targets = M.make_batch(CFG)
    step, opt = M.make_train_step(par, CFG)
    return sp.parallelize(step, mesh=mesh, donate_argnums=donate), (params, opt.init(params), tokens, targets)


def _resnet():
    rng = np.random.default_rng(1)
    params = resnet.init_params()
    step, opt = resnet.make_train_step()
    images = rng.standard_normal((16, 8, 8, 3)).astype(np.float32)
    labels = rng.integers(0, 16, (16,)).astype(np.int32)
    return sp.parallelize(step, mesh=8), (params, opt.init(params), images, labels)


CASES = {
    "gpt_tensor": lambda: _gpt(M.Parallelism.tensor(8), 8),
    "gpt_dp_x_mp": lambda: _gpt(M.Parallelism.data_and_tensor(), ((2, 4), ("dp", "mp"))),
    "gpt_sequence": lambda: _gpt(M.Parallelism.sequence(8), 8),
    # donated state comes back as it went in: ties carried back as hints
    "gpt_dp_x_mp_donated": lambda: _gpt(M.Parallelism.data_and_tensor(), ((2, 4), ("dp", "mp")), (0, 1)),
    "gpt_sequence_donated": lambda: _gpt(M.Parallelism.sequence(8), 8, (0, 1)),
    "resnet": _resnet,
}


def _propagated(pf, args, memoize: bool):
    graph, _ = pf._trace(args, {})
    graph = BindUserStrategies()(graph)
    graph = PropagateSharding(memoize=memoize)(graph)
    return ([(op.kind, op.strategy, op.origin) for op in graph.ops],
            [v.layout for v in graph.inputs])


@pytest.mark.parametrize("case", [c if c == "resnet" else pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES)])
def test_memo_gives_the_plan_worked_out_afresh(case):
    pf, args = CASES[case]()
    memoized = _propagated(pf, args, memoize=True)
    afresh = _propagated(pf, args, memoize=False)
    assert len(memoized[0]) == len(afresh[0])
    for n, (a, b) in enumerate(zip(*[m[0] for m in (memoized, afresh)])):
        assert a == b, f"op {n}: memoized {a} vs afresh {b}"
    assert memoized[1] == afresh[1]
