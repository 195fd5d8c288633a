"""mode="auto" under a memory limit (issue 27): candidates in both axis orders,
the FSDP layout ("stored split, gathered at use") as a candidate of every weight,
and the hand plans the search starts from."""
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import shardprop as sp
from shardprop.ir.mesh import Mesh
from shardprop.passes.auto.candidates import factor_assignments, tensor_layouts
from shardprop.passes.plan_core.context import PlanContext, RuleBook

sys.path.insert(0, str(Path(__file__).parent))
from test_auto import assert_close, problem_data, sgd_step, traced_graph  # noqa: E402


def matmul_rule(mesh):
    g = traced_graph(lambda a, b: a @ b, (np.zeros((64, 32), np.float32), np.zeros((32, 16), np.float32)), mesh)
    op = next(op for op in g.ops if op.kind == "dot_general")
    return PlanContext(g, RuleBook()).rule(op)


def test_candidates_take_a_factors_axes_in_both_orders():
    mesh = Mesh(("a", "b"), (2, 4))
    cands = factor_assignments(matmul_rule(mesh), mesh)
    assert any(("a", "b") in c for c in cands) and any(("b", "a") in c for c in cands)
    assert len(set(cands)) == len(cands)
    assert cands[0] == ((), (), ())                      # replicated first
    layouts = {lay.dims for lay in tensor_layouts((64, 32), mesh)}
    assert (("a", "b"), ()) in layouts and (("b", "a"), ()) in layouts
    assert ((), ("b", "a")) in layouts


def test_fixed_axes_keep_their_order():
    mesh = Mesh(("a", "b", "c"), (2, 2, 2))
    rule = matmul_rule(mesh)
    cands = factor_assignments(rule, mesh, [("b", "a"), None, None])
    assert cands and all(c[0] == ("b", "a") for c in cands)


def test_a_plan_in_the_other_axis_order_equals_one_device():
    """The 2048 x 512 SGD step on 2 x 4 takes ('b', 'a') splits for its loss."""
    params, x, y = problem_data(2048, 512, 2)
    f = sp.parallelize(sgd_step, mesh=((2, 4), ("a", "b")), mode="auto")
    assert_close(f(params, x, y), sgd_step(params, x, y), 1e-4)
    plan = f.plan(params, x, y)
    reversed_ = [op for op in plan.graph.ops if getattr(op, "strategy", None) is not None
                 and any(axes == ("b", "a") for axes in op.strategy.factors)]
    assert reversed_
