"""The redistribution planner, checked exhaustively against a NumPy simulation
of the ranks: every (source, target) layout pair of small tensors on 1-D and
2-D meshes must deliver the same global array."""
import itertools

import numpy as np
import pytest

from shardprop.ir.layout import Layout
from shardprop.ir.mesh import Mesh
from shardprop.passes.redistribute import permute_pairs, plan_redistribution
from tests import rank_sim


def all_layouts(rank: int, mesh: Mesh, partial: bool):
    """Every layout: each axis unused, partial, or placed in a dim (any order)."""
    names = mesh.axis_names
    places = ["free"] + (["partial"] if partial else []) + list(range(rank))
    for choice in itertools.product(places, repeat=len(names)):
        per_dim = [[a for a, c in zip(names, choice) if c == d] for d in range(rank)]
        part = tuple(a for a, c in zip(names, choice) if c == "partial")
        for orders in itertools.product(*(itertools.permutations(p) for p in per_dim)):
            yield Layout(tuple(orders), part)


def run_plan(x, src, dst, mesh, rng, **kw):
    steps = plan_redistribution(x.shape, 4, src, dst, mesh, **kw)
    held = rank_sim.scatter(x, src, mesh, rng)
    cur = src
    for s in steps:
        assert s.before == cur
        params = dict(s.params)
        if s.kind == "permute":
            params["pairs"] = permute_pairs(s.before, s.after, x.shape, mesh)
        held = rank_sim.apply(s.kind, params, held, mesh)
        cur = s.after
    assert cur == dst
    truth = rank_sim.gather_truth(held, dst, x.shape, mesh)
    for r in range(mesh.size):
        np.testing.assert_allclose(truth[r], rank_sim.block(x, dst, r, mesh), rtol=1e-9, atol=1e-9)
    return steps


MESHES = [Mesh(("a",), (2,)), Mesh(("a",), (4,)), Mesh(("a", "b"), (2, 2)), Mesh(("a", "b"), (2, 4))]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("shape", [(8,), (8, 16)], ids=str)
def test_every_layout_pair_preserves_the_array(mesh, shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape)
    valid = lambda l, part: not l.problems(shape, mesh)  # noqa: E731
    sources = [l for l in all_layouts(len(shape), mesh, True) if valid(l, True)]
    targets = [l for l in all_layouts(len(shape), mesh, False) if valid(l, False)]
    for src in sources:
        for dst in targets:
            run_plan(x, src, dst, mesh, rng)


def test_partial_to_sharded_is_one_reduce_scatter():
    mesh = Mesh(("a0", "a1", "a2"), (2, 2, 2))
    src = Layout((("a0",), ()), ("a1", "a2"))
    dst = Layout((("a0",), ("a1", "a2")))
    steps = plan_redistribution((16, 16), 4, src, dst, mesh)
    assert [s.kind for s in steps] == ["reduce_scatter"]
    assert dict(steps[0].params) == {"axes": ("a1", "a2"), "dim": 1}


def test_mindspore_form_is_all_reduce_then_slice():
    mesh = Mesh(("a0", "a1", "a2"), (2, 2, 2))
    src = Layout((("a0",), ()), ("a1", "a2"))
    dst = Layout((("a0",), ("a1", "a2")))
    steps = plan_redistribution((16, 16), 4, src, dst, mesh, allow_reduce_scatter=False)
    assert [s.kind for s in steps] == ["all_reduce", "slice"]
    assert steps[0].wire_bytes == 2 * steps_bytes_reduce_scatter(mesh, src, dst)


def steps_bytes_reduce_scatter(mesh, src, dst):
    return plan_redistribution((16, 16), 4, src, dst, mesh)[0].wire_bytes


def test_moving_an_axis_between_dims_is_all_to_all():
    mesh = Mesh(("a",), (4,))
    steps = plan_redistribution((8, 8), 4, Layout((("a",), ())), Layout(((), ("a",))), mesh)
    assert [s.kind for s in steps] == ["all_to_all"]


def test_swapping_axes_is_a_permute_not_a_gather():
    mesh = Mesh(("a", "b"), (2, 2))
    steps = plan_redistribution((8,), 4, Layout((("a",),)), Layout((("b",),)), mesh)
    assert [s.kind for s in steps] == ["permute"]


def test_never_through_replicated_when_cheaper_exists():
    mesh = Mesh(("a", "b"), (2, 4))
    # moving "b" from dim 0 to dim 1 while "a" stays: one all_to_all over b
    steps = plan_redistribution((8, 8), 4, Layout((("a", "b"), ())), Layout((("a",), ("b",))), mesh)
    assert [s.kind for s in steps] == ["all_to_all"]


def test_many_axis_mesh_plans_quickly():
    names = tuple(f"d{i}" for i in range(10))
    mesh = Mesh(names, (2,) * 10)
    src = Layout((names[:3], names[3:]))
    dst = Layout((names, ()))
    steps = plan_redistribution((1024, 1024), 4, src, dst, mesh)
    assert [s.kind for s in steps] == ["all_to_all"]
