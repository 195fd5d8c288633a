"""Programs nobody hand-picked that once crashed or were accepted wrongly (issue 11),
each in its smallest form. Every one is checked against one device, or for the
message a user gets."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardprop as sp
from tests.helpers import assert_trees_close, check_parallel, rand

MESH_2x4 = ((2, 4), ("dp", "mp"))


# -- size-1 dims are legitimate everywhere -----------------------------------------
def test_mark_on_a_tensor_with_a_size1_dim():
    x = np.arange(4.0, dtype=np.float32).reshape(4, 1)
    check_parallel(lambda x: sp.shard(jnp.tanh, ((2, 1),))(x), (x,))
    check_parallel(lambda x: sp.shard(jnp.tanh, ((1, 1),))(x), (x,))


def test_broadcast_operand_marked_like_mindspore():
    """A (128, 1) multiplier marked ((4, 2), (4, 1)) next to a (128, 96) operand."""
    rng = np.random.default_rng(0)
    a, b, bias = rand(rng, 128, 96), rand(rng, 128, 1), rand(rng, 1, 96)
    check_parallel(lambda a, b: sp.shard(jnp.multiply, ((4, 2), (4, 1)))(a, b), (a, b))
    check_parallel(lambda a, c: sp.shard(jnp.add, ((4, 2), (1, 2)))(a, c), (a, bias))


def test_split_above_one_on_a_size1_dim_is_a_clear_error():
    with pytest.raises(sp.ShardingError, match=r"dim 1 \(size 1\) into 2 parts"):
        sp.parallelize(lambda x: sp.shard(jnp.tanh, ((2, 2),))(x), mesh=8)(np.ones((4, 1), np.float32))


# -- jax's own layout primitives ----------------------------------------------------
def test_inputs_placed_on_an_explicit_mesh():
    """Arrays laid out on a mesh with Explicit axes (jax.make_mesh's default) carry
    shardings in their types; the compiler plans from shapes and runs on its own mesh,
    also inside the caller's ``jax.set_mesh``."""
    rng = np.random.default_rng(1)
    a, b = rand(rng, 8, 16), rand(rng, 16)
    mesh = jax.make_mesh((2, 4), ("dp", "mp"))
    ad = jax.device_put(a, NamedSharding(mesh, P("dp", "mp")))
    bd = jax.device_put(b, NamedSharding(mesh, P("mp")))
    f = lambda a, b: jnp.where(b > 0, a, b)  # noqa: E731
    want = jax.jit(f)(a, b)
    assert_trees_close(sp.parallelize(f, mesh=mesh)(ad, bd), want)
    with jax.set_mesh(mesh):
        assert_trees_close(sp.parallelize(f, mesh=mesh)(ad, bd), want)


def test_reshard_primitive_is_a_layout_request():
    """``jax.sharding.reshard`` (Explicit axes) is honoured like with_sharding_constraint."""
    mesh = jax.make_mesh((2, 4), ("dp", "mp"))
    x = np.arange(128.0, dtype=np.float32).reshape(8, 16)

    def f(a):
        return jax.sharding.reshard(a * 2, P("dp", None)) + 1
    pf = sp.parallelize(f, mesh=mesh)
    assert_trees_close(pf(x), x * 2 + 1)
    add = [op for op in pf.plan(x).ops if op.primitive == "add"][0]
    assert add.in_strategy[0] == (2, 1) and "sharding_constraint" in add.origin


# -- constants ------------------------------------------------------------------------
def test_scan_whose_per_step_output_is_a_python_float():
    c0, xs = np.zeros(4, np.float32), np.ones((6, 4), np.float32)
    f = lambda c, xs: jax.lax.scan(lambda c, x: (c + x, 0.), c, xs)  # noqa: E731
    assert_trees_close(sp.parallelize(f, mesh=8)(c0, xs), jax.jit(f)(c0, xs))


def test_function_returning_python_constants():
    x = np.ones((6, 4), np.float32)
    f = lambda x: (x.sum(), 3.0, 2)  # noqa: E731
    got, want = sp.parallelize(f, mesh=8)(x), jax.jit(f)(x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert np.asarray(g).dtype == np.asarray(w).dtype


# -- strategies are checked where the user wrote them -------------------------------
def _unused(strategy, shape=(8, 8)):
    def f(x):
        sp.shard(jnp.tanh, strategy)(x)      # result unused: its strategy is still the user's word
        return x * 2
    return f, np.ones(shape, np.float32)


@pytest.mark.parametrize("strategy, mesh, shape, words", [
    (((4, 4),), 8, (8, 8), "need 16 devices"),
    ((P("zz", None),), MESH_2x4, (8, 8), "names mesh axis 'zz'"),
    ((P("dp", "dp"),), MESH_2x4, (8, 8), "'dp' is used twice"),
    ((P(None, "mp"),), MESH_2x4, (8, 6), "not divisible by its split count 4"),
])
def test_invalid_strategy_on_an_unused_result_is_an_error(strategy, mesh, shape, words):
    f, x = _unused(strategy, shape)
    with pytest.raises(sp.ShardingError) as e:
        sp.parallelize(f, mesh=mesh)(x)
    msg = str(e.value)
    assert words in msg
    assert "shard(tanh)" in msg and "test_regressions.py:" in msg       # operator and source line
    assert f"shapes:   ({shape},)" in msg and "strategy:" in msg and "fix:" in msg


@pytest.mark.parametrize("fn", [jnp.add, lambda a, b: a.at[jnp.array([3, 0, 1, 2])].set(b[:4])],
                         ids=["add", "scatter"])
def test_partition_specs_that_split_one_factor_two_ways_are_an_error_under_grad(fn):
    """Under grad the marked op may be gone (a linear op's gradient does not need it) or
    rewritten; the mismatch is found on the marked function itself (fuzz seed 30001 #1166)."""
    a, b = np.ones((5, 8), np.float32), np.ones((5, 8), np.float32)
    g = jax.grad(lambda a, b: jnp.sum(sp.shard(fn, (P(None, ("dp", "mp")), P(None, None)))(a, b)), argnums=(0, 1))
    with pytest.raises(sp.ShardingError) as e:
        sp.parallelize(g, mesh=MESH_2x4)(a, b)
    msg = str(e.value)
    assert "same dimension" in msg and "('dp', 'mp') and ()" in msg and "test_regressions.py:" in msg
    assert "fix:" in msg and "shapes:" in msg


def test_out_strategy_that_does_not_match_the_outputs_names_them():
    with pytest.raises(sp.ShardingError) as e:
        sp.parallelize(lambda x: (x * 2, x + 1), mesh=8, out_strategy=((8, 1),))(np.ones((8, 8), np.float32))
    msg = str(e.value)
    assert "out_strategy does not match the structure of the outputs" in msg
    assert "the outputs are ((8, 8), (8, 8))" in msg and "arguments" not in msg
    assert "test_regressions.py:" in msg and "fix:" in msg


def test_out_strategy_one_entry_for_a_function_with_one_output():
    """MindSpore style, one entry per output, also when there is only one output."""
    x = np.arange(128.0, dtype=np.float32).reshape(8, 16)
    pf = sp.parallelize(lambda x: jnp.cumsum(x, axis=1), mesh=8, out_strategy=((1, 8),))
    assert_trees_close(pf(x), np.cumsum(x, axis=1))
    assert pf.plan(x).graph.outputs[0].layout.splits(pf.plan(x).mesh) == (1, 8)


@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation"])
def test_marked_scan_under_grad_whose_body_returns_one_value_twice(mode):
    """Under grad the scan body returns its new carry again as a residual for the
    backward: each of the two outputs gets its own boundary layout (it was the first
    one's twice, and the per-rank shapes clashed: 'mul got incompatible shapes')."""
    rng = np.random.default_rng(0)
    c0, xs = rand(rng, 12, 2), rand(rng, 5, 12, 2)

    def f(c, xs):
        scan = sp.shard(lambda c, xs: jax.lax.scan(lambda c, x: (jnp.tanh(c * x), c), c, xs),
                        ((2, 1), (1, 2, 1)))
        c, ys = scan(c, xs)
        return (c * c).sum() + jnp.sum(ys)
    check_parallel(f, (c0, xs), mode=mode)


# -- primitives the fuzzer met without a rule ------------------------------------------
def test_stack_and_its_transpose_unstack():
    rng = np.random.default_rng(5)
    a, b = rand(rng, 8, 4), rand(rng, 8, 4)
    check_parallel(lambda a, b: jnp.stack([a, b], axis=1) * 2, (a, b), in_strategy=((8, 1), (1, 4)))
    check_parallel(lambda a, b: sp.shard(lambda a, b: jnp.stack([a, b], axis=0), ((2, 4), (2, 4)))(a, b), (a, b))


@pytest.mark.parametrize("how", ["set", "max", "min", "mul"])
def test_scatter_that_is_not_an_add(how):
    rng = np.random.default_rng(6)
    a, u = rand(rng, 8, 4), rand(rng, 4, 4)
    rows = np.array([0, 5, 2, 7], np.int32)
    f = lambda a, u: getattr(a.at[rows], how)(u) * 3  # noqa: E731
    for strategy in (((1, 4), (1, 4)), ((8, 1), (1, 1)), ((1, 1), (4, 1))):
        check_parallel(f, (a, u), in_strategy=strategy, grads=how == "set")


@pytest.mark.slow
def test_out_strategy_keeps_the_axes_its_producer_splits_over():
    """A later output dim must not take an axis an earlier dim's producer layout holds
    (the bind reused it: 'mesh axis d0 is used twice')."""
    rng = np.random.default_rng(7)
    x, w = rand(rng, 8, 8), rand(rng, 8, 8)
    for outs in (((2, 2),), ((4, 2),), ((2, 4),)):
        check_parallel(lambda x, w: sp.shard(jnp.matmul, ((1, 2), (2, 1)), outs)(x, w) * 2, (x, w))
        check_parallel(lambda x: sp.shard(jnp.tanh, ((1, 2),), outs)(x) * 2, (x,))


def test_split_counts_of_the_wrong_rank_are_an_error_not_a_crash():
    x = np.ones((8, 8), np.float32)
    with pytest.raises(sp.ShardingError, match="has 1 split counts but that tensor has rank 2"):
        sp.parallelize(lambda x, w: sp.shard(jnp.matmul, ((2,), (2, 1)))(x, w), mesh=8)(x, x)


def test_parallelize_strategy_errors_name_the_call():
    x = np.ones((6, 8), np.float32)
    with pytest.raises(sp.ShardingError) as e:
        sp.parallelize(lambda x: x * 2, mesh=8, in_strategy=((4, 1),))(x)
    msg = str(e.value)
    assert msg.startswith("parallelize(<lambda>) at test_regressions.py:")
    assert "in_strategy for input x splits dim 0 (size 6) into 4 parts" in msg and "shapes:" in msg


def test_a_mark_that_splits_a_dim_the_op_needs_whole_says_to_leave_it_unsplit():
    x = np.ones((8, 16), np.float32)
    with pytest.raises(sp.ShardingError) as e:
        sp.parallelize(lambda x: sp.shard(lambda t: jnp.cumsum(t, axis=1), ((1, 8),))(x), mesh=8)(x)
    msg = str(e.value)
    assert "needs that dim whole" in msg and "fix:      leave that dim unsplit (1)" in msg


def test_all_to_all_between_size1_dims_runs():
    """XLA's CPU verifier once rejected the lowered all_to_all here ("operands with
    different shapes"): its layout assignment split the chunks between size-1 dims
    differently. runtime/lower.py exchanges chunks along a new leading dim instead."""
    rng = np.random.default_rng([2311, 432])
    x2, x3, x5 = rand(rng, 4, 1, 1, 2), rand(rng, 4, 1, 1, 1), rand(rng, 1, 2, 1, 1)

    def f(x2, x3, x5):
        v = jax.lax.conv_general_dilated(x2, x3, (2, 1), "SAME")
        v = jnp.transpose(v, (1, 3, 0, 2))
        return jax.lax.conv_general_dilated(v, x5, (1, 2), "VALID")

    check_parallel(f, (x2, x3, x5), mesh=4, mode="semi_auto")
    g = jax.grad(lambda *a: jnp.mean(jnp.square(f(*a))), argnums=(0, 1, 2))
    assert any(c.kind == "all_to_all" for c in sp.parallelize(g, mesh=4, mode="semi_auto").plan(x2, x3, x5).collectives)


def test_a_scalar_argument_takes_the_empty_strategy():
    """``()`` at a rank-0 argument or output is its strategy (nothing to split), not an
    empty subtree that no longer matches the arguments' structure."""
    s, x = np.float32(2.0), np.arange(8.0, dtype=np.float32)
    f = lambda s, x: (x * s, jnp.sum(x))
    for strategy in ((), P()):
        pf = sp.parallelize(f, mesh=8, in_strategy=(strategy, (8,)), out_strategy=((8,), strategy))
        assert_trees_close(pf(s, x), jax.jit(f)(s, x))
    with pytest.raises(sp.ShardingError, match="rank 0"):
        sp.parallelize(f, mesh=8, in_strategy=((2,), (8,)))(s, x)


@pytest.mark.parametrize("used", [False, True])
def test_empty_split_counts_on_an_array_are_an_error(used):
    """``()`` at a rank-1 argument is split counts of the wrong length, like (1, 1); it
    was read as PartitionSpec() (replicated) and accepted (fuzz seed 60004 #1400, where
    the argument was not even used)."""
    def f(a, b, c):
        return jnp.einsum("i,p->pi", c, a) + (b.sum() if used else 0)
    args = (np.ones(4, np.float32), np.ones(6, np.float32), np.ones(8, np.float32))
    with pytest.raises(sp.ShardingError, match=r"in_strategy for input b has 0 split counts but the tensor has rank 1"):
        sp.parallelize(f, mesh=((2, 4), ("dp", "mp")), in_strategy=(None, (), None))(*args)
    with pytest.raises(sp.ShardingError, match=r"out_strategy .*0 split counts but the tensor has rank 2"):
        sp.parallelize(f, mesh=8, out_strategy=())(*args)


def test_in_strategy_for_optimizer_state_namedtuples():
    """optax states are NamedTuples: a strategy tree shaped like one, with () for the
    step count, is read leaf by leaf (rebuilding it once failed on the NamedTuple)."""
    import optax
    rng = np.random.default_rng(3)
    w, x = rand(rng, 16, 4), rand(rng, 16, 4)
    opt = optax.adam(1e-2)
    state = opt.init(w)

    def step(w, state, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(w * x)))(w)
        u, state = opt.update(g, state, w)
        return optax.apply_updates(w, u), state

    strategy = jax.tree_util.tree_map(lambda a: () if np.ndim(a) == 0 else (8, 1), state)
    pf = sp.parallelize(step, mesh=8, in_strategy=((8, 1), strategy, (8, 1)))
    assert_trees_close(pf(w, state, x), jax.jit(step)(w, state, x))


def test_partition_specs_shorter_than_the_rank_are_checked_per_dim():
    """A PartitionSpec may leave trailing dims out (they are unsplit): the agreement check
    of a marked function's factors reads them as ()."""
    rng = np.random.default_rng(5)
    a, b = rand(rng, 8, 4), rand(rng, 8, 4)
    check_parallel(lambda a, b: sp.shard(jnp.add, (P("dp"), P("dp", None)))(a, b), (a, b), mesh=MESH_2x4)
    with pytest.raises(sp.ShardingError, match=r"input 0 dim 1 .* split over mesh axes \('mp',\) and \(\)"):
        sp.parallelize(lambda a, b: sp.shard(jnp.add, (P("dp", "mp"), P("dp")))(a, b), mesh=MESH_2x4)(a, b)


def test_local_slices_lower_under_x64():
    """With jax_enable_x64 a Python 0 start became int64 beside axis_index's int32 and
    dynamic_slice refused the mix (the fuzzer's float64 second opinion hit it)."""
    with jax.enable_x64(True):
        x = np.arange(64.0).reshape(8, 8)             # float64
        f = lambda x: sp.shard(jnp.tanh, ((8, 1),))(x)
        pf = sp.parallelize(f, mesh=8, in_strategy=((1, 1),))    # replicated in, split by the mark
        assert any(c.kind == "slice" for c in pf.plan(x).collectives)
        assert_trees_close(pf(x), jax.jit(f)(x))


def test_a_split_of_the_major_part_crosses_a_reshape_without_common_refinement():
    """(4, 16, 3) -> (8, 3, 4, 2) has no common refinement (16 = 2 x 8 meets 3 x 4 x 2),
    but the split of dim 1 over 'c' takes its major 2, which lands whole in the result's
    dim 0: the blocks stay contiguous. It was refused (seed 60002 #118)."""
    x = np.arange(192, dtype=np.float32).reshape(4, 16, 3)

    def f(x):
        v = sp.shard(lambda a: a.reshape((8, 3, 4, 2)), (P(("a", "b"), "c", None),))(x)
        return jnp.sum(v, axis=(0, 2, 3)), v
    check_parallel(f, (x,), mesh=((2, 2, 2), ("a", "b", "c")))
    # (8, 7) -> (2, 2, 7, 2): dim 0 split 4 ways is its major 2 x 2 (seed 60003 #891)
    y = np.arange(56, dtype=np.float32).reshape(8, 7)
    check_parallel(lambda y: sp.shard(lambda a: a.reshape((2, 2, 7, 2)), ((4, 1),))(y), (y,), mesh=4)


def test_readers_wishing_one_axis_on_two_dims_of_an_argument():
    """A weight read by an einsum whose batch dim a scan mark splits on one axis and whose
    contracted dim a reshape mark splits on both: the two wishes for the weight disagree,
    and a reshape of the weight took both (seed 90001, program 2639: 'mesh axes used twice')."""
    import optax

    def f(x2, x3, x6, x8, x10):
        v6 = jnp.einsum("ij,pji->pi", x6, x2)

        def body(c, x):
            c = c * jnp.tanh(x) + x
            return c, c * 2.0
        _, v7 = sp.shard(lambda a, b: jax.lax.scan(body, a, b), ((2, 1), (1, 2, 1)))(v6, x3)
        v8 = jax.lax.cond(x2.reshape(-1)[0] > 0, lambda a, b: a + jnp.tanh(b), lambda a, b: a - b, x10, x8)
        v11 = sp.shard(lambda a: a.reshape((2, 4)), ((1, 4),))(x6)
        return v7, v8, v11
    opt = optax.sgd(0.1)

    def step(params, opt_state, x6, x8, x10):
        def loss(params):
            return sum(jnp.mean(jnp.square(o)) for o in f(params["x2"], params["x3"], x6, x8, x10))
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    rng = np.random.default_rng(0)
    params = {"x2": rand(rng, 4, 8, 1), "x3": rand(rng, 1, 4, 1)}
    args = (params, opt.init(params), rand(rng, 1, 8), rand(rng, 1, 1), rand(rng, 1, 1))
    assert_trees_close(sp.parallelize(step, mesh=4, progress=False)(*args), jax.jit(step)(*args))


# -- mode="auto" -----------------------------------------------------------------------
def test_auto_on_a_marked_batched_matmul():
    """Issue 27: the search's candidate filter dropped every candidate of an argument
    whose costs differed by less than its tolerance (a ~ b ~ c, a beats c), and the
    bound then took the minimum of nothing."""
    rng = np.random.default_rng(0)
    x1, x4 = rand(rng, 12, 8, 1, 16), rand(rng, 12, 8, 16, 2)

    def f(a, b):
        return sp.shard(lambda a, b: jnp.matmul(a, b), (P("mp", "dp"), P("mp", "dp")))(a, b)
    check_parallel(f, (x1, x4), mesh=MESH_2x4, mode="auto", progress=False)


def test_candidate_filter_keeps_one_of_every_chain_of_near_ties():
    """Near ties within the tolerance are not transitive: the filter must still keep a
    candidate no worse (within the tolerance) than each one it drops."""
    from shardprop.passes.auto.milp import _undominated
    tol = 1e-12
    # 0 ~ 1 and 1 ~ 2 tie within tol on both features, but 2 beats 0 by more than tol
    unary = {0: np.array([1.9 * tol, 0.95 * tol, 0.0])}
    kept = _undominated(0, unary, [], {})
    assert list(kept) == [2]
    feats = np.stack([unary[0]], axis=1)
    for j in range(3):
        assert any(np.all(feats[i] <= feats[j] + tol) for i in kept)


@pytest.mark.slow
def test_a_plan_made_to_fit_by_switching_never_makes_a_move_the_model_excludes():
    """Fuzz seed 20261230, program 1527: under a memory limit, a hand family over it was
    made to fit by switching (``repair.fit_by_switching``), a batch of switches each priced
    against the plan before it; together they asked a partial sum over one axis to become
    one over another, and pricing that plan raised a ValueError. Such a plan is no plan:
    the limit, 0.7 of this tiny step's free peak, is then an error that names it."""
    rng = np.random.default_rng([20261230, 1527])
    x0 = np.asarray(rng.standard_normal((3, 4, 2)), np.float32)
    x1 = np.asarray(rng.standard_normal((3, 2, 7)), np.float32)
    x2 = np.asarray(rng.standard_normal((2,)), np.float32)

    def loss(x0, x1, x2):
        v1 = jax.lax.reduce_window(jnp.matmul(x0, x1), -jnp.inf, jax.lax.max, (2, 1, 3), (2, 1, 3), "VALID")
        v2 = jnp.einsum("ijk,p->pijk", x1, x2)
        return jnp.mean(jnp.square(v1)) + jnp.mean(jnp.square(v2))
    step = jax.value_and_grad(loss, argnums=(0, 1, 2))
    peak = sp.parallelize(step, mesh=8, mode="auto", progress=False).plan(x0, x1, x2).cost.peak_memory
    limited = sp.parallelize(step, mesh=8, mode="auto", memory_limit=int(0.7 * peak), progress=False)
    with pytest.raises(sp.ShardingError, match=r"no plan fits memory_limit=[\d,]+ bytes per device"):
        limited(x0, x1, x2)
