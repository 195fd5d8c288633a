"""Reshape's factor model: a split may cross a reshape only where every device's
block stays contiguous (the major part of a merged dim, or whole sub-factors in
order, each major factor fully split before a minor one takes an axis); every
other layout is redistributed first.

Checked three ways: the issue's programs (issue 11, symptoms 1 and 3); every
factor assignment of many reshapes against a NumPy simulation of the ranks
(what each rank holds); and every input (and output) layout of those reshapes
on three meshes through the whole compiler, forward and gradients, against one
device. Many cases share one program, so the whole file compiles a handful."""
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardprop as sp
from shardprop.ir.graph import Op, TensorType, Value, is_collective
from shardprop.ir.layout import Layout
from shardprop.ir.mesh import Mesh
from shardprop.passes.insert_reshards import TIE
from shardprop.passes.rules import rule_for
from shardprop.passes.sharding import OpStrategy, broken_nesting
from tests import rank_sim
from tests.helpers import assert_trees_close, check_parallel, rand
from tests.test_redistribute import all_layouts

# (shape in, shape out): merges, splits, both at once, size-1 dims, primes, ranks 1 to 4
PAIRS = [
    ((8,), (4, 2)), ((4, 2), (8,)), ((8,), (2, 2, 2)), ((2, 2, 2), (8,)), ((4, 2), (2, 4)),
    ((2, 6), (4, 3)), ((4, 3), (2, 6)), ((6, 4), (4, 6)), ((12, 10), (8, 15)), ((6, 4), (3, 8)), ((4, 6), (2, 12)),
    ((3, 4), (12,)), ((12,), (3, 4)), ((5, 4), (20,)), ((4, 7), (2, 14)), ((2, 3, 4), (6, 4)),
    ((4, 1, 2), (8,)), ((1, 8), (8, 1)), ((8,), (2, 1, 4)), ((2, 1, 4), (1, 4, 2)), ((1, 1), (1,)),
    ((2, 2, 4), (16,)), ((2, 2, 4), (4, 4)), ((8, 2), (2, 8)), ((4, 4, 2), (2, 16)),
    ((2, 2, 2, 2), (4, 4)), ((16,), (2, 2, 2, 2)), ((2, 4, 2, 3), (8, 6)), ((4, 2, 6), (2, 4, 2, 3)),
    ((2, 2, 2, 2), (2, 4, 2)), ((4, 2, 2, 2), (2, 2, 8)), ((2, 3, 2, 2), (6, 4)), ((2, 2, 2, 2), (16,)),
    # no common refinement of the whole block: a leading run of factors, then whole rests
    ((4, 16, 3), (8, 3, 4, 2)), ((6, 10), (4, 15)), ((4, 9), (6, 6)), ((8, 6), (4, 12, 1)),
]

NAMED = {"2x4": Mesh(("a", "b"), (2, 4)), "2x2x2": Mesh(("a", "b", "c"), (2, 2, 2))}


def reshape_rule(a, b):
    op = Op("reshape", [Value(TensorType(tuple(a), "float32"))], [Value(TensorType(tuple(b), "float32"))],
            {"new_sizes": tuple(b), "dimensions": None, "sharding": None})
    return rule_for(op)


# -- the programs --------------------------------------------------------

@pytest.mark.parametrize("mode", ["sharding_propagation", "semi_auto"])
def test_merge_with_the_minor_dim_split_by_in_strategy(mode):
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    pf = check_parallel(lambda x: x.reshape(8), (x,), mesh=8, in_strategy=((1, 2),), mode=mode)
    np.testing.assert_array_equal(pf(x), np.arange(8, dtype=np.float32))


def test_mark_after_a_split_that_shards_its_minor_part():
    x = np.arange(12, dtype=np.float32)

    def f(x):
        return sp.shard(lambda a: a * 2, ((1, 4),))(x.reshape(3, 4))
    pf = check_parallel(f, (x,), mesh=8)
    np.testing.assert_array_equal(pf(x), 2 * x.reshape(3, 4))


def test_out_strategy_splitting_the_minor_part_of_a_split():
    x = np.arange(16, dtype=np.float32)
    check_parallel(lambda x: jnp.sin(x.reshape(4, 4)), (x,), mesh=8, grads=False, out_strategy=((1, 4),))
    check_parallel(lambda x: jnp.sin(x.reshape(4, 4)), (x,), mesh=8, in_strategy=((4,),))


@pytest.mark.parametrize("shape", [(2, 2, 4), (8, 8, 24)], ids=str)
def test_flatten_after_a_mark_on_the_minor_dims(shape):
    """Issue 11 symptom 3: a ValueError at (8, 8, 24), wrong numbers at (2, 2, 4)."""
    x = rand(np.random.default_rng(0), *shape)

    def f(x):
        return sp.shard(jax.nn.relu, (P(None, "dp", "mp"),))(x).reshape(-1)
    check_parallel(f, (x,), mesh=((2, 4), ("dp", "mp")))


def test_a_mark_on_the_reshape_itself_that_breaks_contiguity_is_a_clear_error():
    x = np.ones((4, 2), np.float32)

    def f(x):
        return sp.shard(lambda a: a.reshape(8), ((1, 2),))(x)
    line = f.__code__.co_firstlineno + 1
    with pytest.raises(sp.ShardingError) as info:
        sp.parallelize(f, mesh=8).plan(x)
    msg = str(info.value)
    assert f"test_reshape.py:{line}" in msg and "reshape" in msg, msg
    assert "operand 0 dim 1 is split" in msg and "minor" in msg and "result 0 dim 0" in msg, msg
    assert "split the major part" in msg and "fix:" in msg, msg
    # the major part split, or both parts with the major one whole, are fine
    check_parallel(lambda x: sp.shard(lambda a: a.reshape(8), ((2, 1),))(x), (x,), mesh=8)
    check_parallel(lambda x: sp.shard(lambda a: a.reshape(8), ((4, 2),))(x), (x,), mesh=8)


# -- every factor assignment against the rank simulation ---------------------------

def assignments(num_factors: int, mesh: Mesh):
    """Every way to give each mesh axis to one factor or none, in every order."""
    for choice in itertools.product([None] + list(range(num_factors)), repeat=len(mesh.axis_names)):
        per = [[a for a, c in zip(mesh.axis_names, choice) if c == f] for f in range(num_factors)]
        for orders in itertools.product(*(itertools.permutations(p) for p in per)):
            yield tuple(orders)


def naive_layout(rule, dims, factors) -> Layout:
    """A tensor's layout read off the factors without the contiguity rule (the old bug)."""
    return Layout(tuple(tuple(a for f in fs for a in factors[f]) for fs in dims))


@pytest.mark.parametrize("mesh, least", [(NAMED["2x4"], 80), (NAMED["2x2x2"], 500)], ids=list(NAMED))
def test_every_valid_assignment_holds_the_reshaped_blocks(mesh, least):
    """A strategy the rule allows: each rank's reshaped local block is its block of the
    reshaped array. One it refuses only for contiguity: some rank would hold wrong data."""
    checked = refused = 0
    for a, b in PAIRS:
        rule = reshape_rule(a, b)
        x = np.arange(math.prod(a), dtype=np.float64).reshape(a)
        y = x.reshape(b)
        for factors in assignments(rule.num_factors, mesh):
            st = OpStrategy(rule, factors)
            problems = st.problems(mesh)
            broken = broken_nesting(rule, factors, mesh)
            if not problems:
                lin, lout = st.operand_layout(0, len(a), mesh), st.result_layout(0, mesh)
                for r in range(mesh.size):
                    local = rank_sim.block(x, lin, r, mesh).reshape(lout.local_shape(b, mesh))
                    np.testing.assert_array_equal(local, rank_sim.block(y, lout, r, mesh),
                                                  err_msg=f"{a}->{b} factors {factors} rank {r}")
                checked += 1
            elif broken and len(problems) == 1:
                lin, lout = naive_layout(rule, rule.operands[0], factors), naive_layout(rule, rule.results[0], factors)
                wrong = [r for r in range(mesh.size)
                         if not np.array_equal(rank_sim.block(x, lin, r, mesh).reshape(lout.local_shape(b, mesh)),
                                               rank_sim.block(y, lout, r, mesh))]
                assert wrong, f"{a}->{b}: factors {factors} refused, yet every rank's block is right"
                refused += 1
    assert checked >= least and refused >= 60, (checked, refused)


# -- every layout through the compiler ------------------------------------------------

def spec(layout: Layout) -> P:
    return P(*(None if not d else d[0] if len(d) == 1 else tuple(d) for d in layout.dims))


def split_counts(shape, n: int) -> list[tuple]:
    """Every split-count strategy of ``shape`` on ``n`` devices (MindSpore style)."""
    options = [[k for k in range(1, min(s, n) + 1) if s % k == 0 and n % k == 0] for s in shape]
    return [c for c in itertools.product(*options) if n % math.prod(c) == 0]


MESHES = {"8": 8, "2x4": ((2, 4), ("a", "b")), "2x2x2": ((2, 2, 2), ("a", "b", "c"))}


def layouts_on(shape, mesh) -> list:
    """Every strategy the mesh allows for a tensor of ``shape``."""
    if isinstance(mesh, int):
        return split_counts(shape, mesh)
    ir_mesh = Mesh(mesh[1], mesh[0])
    return [spec(l) for l in all_layouts(len(shape), ir_mesh, False) if not l.problems(shape, ir_mesh)]


def cases_on(mesh, side: str, per_pair=None, seed=0) -> list:
    """(shape in, shape out, strategy of the pinned side) for every pair and every
    strategy of that side (or ``per_pair`` of them, drawn)."""
    rng = np.random.default_rng(seed)
    out = []
    for a, b in PAIRS:
        options = layouts_on(a if side == "in" else b, mesh)
        if per_pair is not None and len(options) > per_pair:
            options = [options[k] for k in sorted(rng.choice(len(options), per_pair, replace=False))]
        out += [(a, b, s) for s in options]
    return out


def program(cases, op=lambda x: x):
    """One function of many inputs, each reshaped (after ``op``): one compile for all cases."""
    targets = [b for _, b, _ in cases]
    rng = np.random.default_rng(1)

    def f(*xs):
        return tuple(op(x).reshape(t) for x, t in zip(xs, targets))
    return f, tuple(rand(rng, *a) for a, _, _ in cases)


def simulate(graph, xs) -> list:
    """Run the per-rank program in NumPy (rank_sim): per output, what each rank holds."""
    mesh = graph.mesh
    held = {v: [rank_sim.block(x, v.layout, r, mesh) for r in range(mesh.size)] for v, x in zip(graph.inputs, xs)}
    for op in graph.ops:
        blocks = held[op.inputs[0]]
        if is_collective(op):
            held[op.outputs[0]] = rank_sim.apply(op.kind, op.params, blocks, mesh)
        elif op.kind == TIE:   # (an argument gathered per use: the tie before its gather is an identity)
            held[op.outputs[0]] = blocks
        else:
            assert op.kind == "reshape", op.kind
            held[op.outputs[0]] = [b.reshape(op.local_params["new_sizes"]) for b in blocks]
    return [held[v] for v in graph.outputs]


@pytest.mark.parametrize("side", ["in", "out"])
@pytest.mark.parametrize("mesh", list(MESHES.values()), ids=list(MESHES))
@pytest.mark.slow
def test_every_layout_each_rank_holds_its_block(mesh, side):
    """Every input layout (operand pinned) and every output layout (result pinned) of
    every pair: the compiled per-rank program, run in the rank simulation, leaves
    each rank exactly its block of the reshaped array."""
    cases = cases_on(mesh, side)
    f, xs = program(cases)
    strategies = {f"{side}_strategy": tuple(s for *_, s in cases)}
    graph = sp.parallelize(f, mesh=mesh, verify=True, **strategies).plan(*xs).graph
    for (a, b, s), x, v, ranks in zip(cases, xs, graph.outputs, simulate(graph, xs)):
        for r, got in enumerate(ranks):
            np.testing.assert_array_equal(got, rank_sim.block(x.reshape(b), v.layout, r, graph.mesh),
                                          err_msg=f"{a} -> {b}, {side}_strategy {s}, rank {r}")


@pytest.mark.parametrize("mesh", list(MESHES.values()), ids=list(MESHES))
@pytest.mark.slow
def test_drawn_layouts_forward_and_grad_against_one_device(mesh):
    """Through XLA, forward and gradients: one drawn input layout per pair, and one
    drawn output layout per pair (forward). (Every layout runs in the rank simulation
    above; XLA compiles are what this file's time goes to.)"""
    cases = cases_on(mesh, "in", per_pair=1, seed=2)
    f, xs = program(cases, jnp.sin)
    check_parallel(f, xs, mesh=mesh, in_strategy=tuple(s for *_, s in cases))
    cases = cases_on(mesh, "out", per_pair=1, seed=3)
    f, xs = program(cases, jnp.sin)
    pf = sp.parallelize(f, mesh=mesh, verify=True, out_strategy=tuple(s for *_, s in cases))
    assert_trees_close(pf(*xs), jax.jit(f)(*xs))
