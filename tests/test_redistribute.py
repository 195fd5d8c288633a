"""The redistribution planner, checked exhaustively against a NumPy simulation
of the ranks: every (source, target) layout pair of small tensors of ranks 1 to
4 on 1-D, 2-D and 3-D meshes must deliver the same global array."""
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


def run_plan(x, src, dst, mesh, rng, held=None, want=None, **kw):
    """Plan src -> dst, run the steps in the rank simulation and compare every rank's
    holding with its block of ``x`` (``held``/``want``: the source holdings and target
    blocks, when the caller has them already)."""
    steps = plan_redistribution(x.shape, 4, src, dst, mesh, **kw)
    held = rank_sim.scatter(x, src, mesh, rng) if held is None else held
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
    want = [rank_sim.block(x, dst, r, mesh) for r in range(mesh.size)] if want is None else want
    if any(t.shape != w.shape for t, w in zip(truth, want)) or np.abs(np.stack(truth) - np.stack(want)).max() > 1e-9:
        for r in range(mesh.size):   # say which rank holds what
            np.testing.assert_allclose(truth[r], want[r], rtol=1e-9, atol=1e-9,
                                       err_msg=f"{src} -> {dst} by {[s.kind for s in steps]}, rank {r}")
    return steps


def canonical(layout: Layout, mesh: Mesh) -> Layout:
    """``layout`` with its axes renamed in order of first use (dims, then partial)."""
    used = [a for d in layout.dims for a in d] + list(layout.partial)
    name = dict(zip(used, mesh.axis_names))
    return Layout(tuple(tuple(name[a] for a in d) for d in layout.dims),
                  mesh.sort_axes(name[a] for a in layout.partial), layout.partial_op)


def check_every_pair(shape, mesh, up_to_renaming=False):
    """Every valid source (partial or not) to every valid target. ``up_to_renaming``
    (a mesh whose axes all have one size): one source per class of layouts that differ
    only by a renaming of the axes, which maps the mesh onto itself; every target."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape)
    sources = [l for l in all_layouts(len(shape), mesh, True) if not l.problems(shape, mesh)]
    if up_to_renaming:
        assert len(set(mesh.axis_sizes)) == 1
        sources = [l for l in sources if l == canonical(l, mesh)]
    targets = [l for l in all_layouts(len(shape), mesh, False) if not l.problems(shape, mesh)]
    want = {dst: [rank_sim.block(x, dst, r, mesh) for r in range(mesh.size)] for dst in targets}
    for src in sources:
        held = rank_sim.scatter(x, src, mesh, rng)
        for dst in targets:
            run_plan(x, src, dst, mesh, rng, held=held, want=want[dst])
    return len(sources) * len(targets)


MESHES = [Mesh(("a",), (2,)), Mesh(("a",), (4,)), Mesh(("a", "b"), (2, 2)), Mesh(("a", "b"), (2, 4))]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("shape", [(8,), (8, 16)], ids=str)
def test_every_layout_pair_preserves_the_array(mesh, shape):
    check_every_pair(shape, mesh)


@pytest.mark.parametrize("shape", [(2, 4, 2, 4), (4, 2, 8, 2)], ids=str)
def test_every_layout_pair_of_rank_4_tensors_on_a_2d_mesh(shape):
    check_every_pair(shape, Mesh(("a", "b"), (2, 4)))


@pytest.mark.parametrize("shape", [pytest.param((8, 4), marks=pytest.mark.slow), (4, 8, 2),
                                   pytest.param((2, 4, 2, 4), marks=pytest.mark.slow)], ids=str)
def test_every_layout_pair_on_a_3d_mesh(shape):
    assert check_every_pair(shape, Mesh(("a", "b", "c"), (2, 2, 2)), up_to_renaming=True) > 500


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


@pytest.mark.parametrize("mesh,shape", [(Mesh(("a", "b"), (2, 4)), (8, 4, 2)),
                                        pytest.param(Mesh(("a", "b", "c"), (2, 2, 2)), (4, 8), marks=pytest.mark.slow)],
                         ids=str)
def test_a_moves_price_is_its_planned_steps_price(mesh, shape):
    # redistribution_cost prices the path on the virtual mesh, with each step's bundles
    # read back as the real axes they stand for; it must be what the expanded steps cost,
    # under a model without links, a profile's per-group links and waits, and a terminal
    # value's shared launch (launch_share < 1)
    from shardprop.passes.cost import CostModel, DEFAULT_COST, Link
    from shardprop.passes.redistribute import redistribution_cost
    links = ((((2, 4),), "", Link(1e-5, 1e9)), (((4, 1),), "all_gather", Link(3e-5, 4e8)),
             (((2, 1),), "", Link(2e-6, 5e9)), (((8, 1),), "", Link(4e-5, 2e8)))
    profile = CostModel(links=links, device_count=8, sync_s=9e-4, waits=((((2, 4),), 3e-4), (((4, 1),), 1e-4)))
    models = [DEFAULT_COST, profile, profile.at_step_end(3), DEFAULT_COST.at_step_end(4)]
    sources = [l for l in all_layouts(len(shape), mesh, True) if not l.problems(shape, mesh)]
    targets = [l for l in all_layouts(len(shape), mesh, True) if not l.problems(shape, mesh)]
    priced = 0
    for model in models:
        for src in sources:
            for dst in targets:
                try:
                    want = model.move_time(plan_redistribution(shape, 4, src, dst, mesh, True, model), mesh)
                except ValueError:   # (a move that would create a partial)
                    with pytest.raises(ValueError):
                        redistribution_cost(shape, 4, src, dst, mesh, True, model)
                    continue
                assert redistribution_cost(shape, 4, src, dst, mesh, True, model) == want, (model.name, src, dst)
                priced += 1
    assert priced > 1000


def test_tensors_alike_to_the_planner_share_one_price_and_it_is_each_ones_own():
    # Prices keys a move by the tensor's bytes and which axis products divide each dim
    # (gcd with the device count), not its shape: (24, 4, 2), (8, 4, 6) and (8, 12, 2) are
    # one search; (4, 8, 6), the same bytes, is not (8 does not divide its first dim). Each
    # price must still be what that tensor's own planned steps cost.
    from shardprop.passes.cost import CostModel, Link
    from shardprop.passes.plan_core.pricing import Prices
    mesh = Mesh(("a", "b"), (2, 4))
    links = ((((2, 4),), "", Link(1e-5, 1e9)), (((4, 1),), "all_gather", Link(3e-5, 4e8)),
             (((8, 1),), "", Link(4e-5, 2e8)))
    profile = CostModel(links=links, device_count=8, sync_s=9e-4, waits=((((2, 4),), 3e-4), (((4, 1),), 1e-4)))
    prices = Prices(profile)
    priced = {}
    for shape in [(24, 4, 2), (8, 4, 6), (4, 8, 6), (8, 12, 2)]:
        layouts = [l for l in all_layouts(3, mesh, True) if not l.problems(shape, mesh)]
        for src in layouts:
            for dst in layouts:
                if src == dst or not set(dst.partial) <= set(src.partial):
                    continue
                for riders in (None, 3):
                    model = profile if riders is None else profile.at_step_end(riders)
                    want = model.move_time(plan_redistribution(shape, 4, src, dst, mesh, True, model), mesh)
                    assert prices(shape, 4, src, dst, mesh, riders) == want, (shape, src, dst, riders)
                    priced[shape] = priced.get(shape, 0) + 1
    alike = priced[(24, 4, 2)]
    assert priced[(8, 4, 6)] == priced[(8, 12, 2)] == alike
    assert len(prices._by_virtual) == alike + priced[(4, 8, 6)]   # (one search for the three alike)


def test_a_cluster_prices_the_same_move_over_nodes_and_inside_one_apart():
    # a cluster's model prices a group by the nodes it spans (no per-group links of a
    # profile): gathering over the axis across nodes and over the one inside them, of the
    # same size, are the same virtual problem and must still be priced apart, each as
    # its own planned steps are (the memo once shared them: a 4 x 4 mesh's plan moved)
    import shardprop as sp
    from shardprop.passes.plan_core.pricing import Prices
    cost = sp.Cluster(4, 4).cost_model()
    mesh = Mesh(("dp", "mp"), (4, 4))
    prices = Prices(cost)
    shape = (64, 64)
    across = prices(shape, 4, Layout((("dp",), ())), Layout(((), ())), mesh)
    inside = prices(shape, 4, Layout((("mp",), ())), Layout(((), ())), mesh)
    assert across > 2 * inside
    for src in (Layout((("dp",), ())), Layout((("mp",), ()))):
        want = cost.move_time(plan_redistribution(shape, 4, src, Layout(((), ())), mesh, True, cost), mesh)
        assert prices(shape, 4, src, Layout(((), ())), mesh) == want
