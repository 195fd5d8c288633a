"""Every sharding rule, checked differentially: parallel == single device,
forward and gradients, float32 to 1e-5. Each case marks one operator so that
the rule under test sees sharded operands."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardprop as sp
from tests.helpers import check_parallel, rand

rng = np.random.default_rng(0)
A = rand(rng, 16, 32)
B = rand(rng, 32, 16)
V = rand(rng, 16)
ROW = rand(rng, 32)
T3 = rand(rng, 8, 16, 32)
T3B = rand(rng, 8, 32, 24)


def mark(x, s):
    """Pin x's layout by marking an identity op (the way a user marks any op)."""
    return sp.shard(lambda t: t * 1.0, (s,))(x)


CASES = {
    # elementwise, unary
    "unary": (lambda a: jnp.exp(mark(a, (2, 4)) * 0.1) + jnp.log(jnp.abs(a) + 1) + jnp.tanh(a)
              + jax.nn.sigmoid(a) + a ** 3 + jax.lax.rsqrt(jnp.abs(a) + 1.0) + jnp.sqrt(jnp.abs(a)), (A,)),
    # binary with implicit and explicit broadcasting, scalars
    "binary_broadcast": (lambda a, v, r: mark(a, (8, 1)) * r + 2.0 - a / (v[:, None] ** 2 + 1.0), (A, V, ROW)),
    "max_min_pow": (lambda a, b: jnp.maximum(mark(a, (4, 2)), 0.5) * jnp.minimum(a, b.T), (A, B)),
    "comparisons_select": (lambda a, b: jnp.where(mark(a, (2, 4)) > b.T, a, -b.T) + (a <= 0.1).astype(jnp.float32),
                           (A, B)),
    "convert": (lambda a: (mark(a, (8, 1)).astype(jnp.bfloat16).astype(jnp.float32) * 0 + a).astype(jnp.float32),
                (A,)),
    "stop_gradient": (lambda a: jax.lax.stop_gradient(mark(a, (2, 4))) * a, (A,)),
    # contractions
    "matmul_row_split": (lambda a, b: sp.shard(jnp.matmul, ((8, 1), (1, 1)))(a, b), (A, B)),
    "matmul_col_split": (lambda a, b: sp.shard(jnp.matmul, ((1, 1), (1, 8)))(a, b), (A, B)),
    "matmul_contract_split": (lambda a, b: jnp.tanh(sp.shard(jnp.matmul, ((1, 8), (8, 1)))(a, b)), (A, B)),
    "matmul_transposed": (lambda a, b: sp.shard(lambda x, y: x.T @ y.T, ((4, 2), (1, 4)))(b, a), (A, B)),
    "batched_dot": (lambda x, y: sp.shard(jnp.matmul, ((2, 2, 2), (2, 2, 1)))(x, y), (T3, T3B)),
    "einsum_batch_last": (lambda x, y: jnp.einsum("bij,bjk->kib", mark(x, (2, 4, 1)), y), (T3, T3B)),
    # shapes
    "reshape_merge_split": (lambda x: jnp.sin(mark(x, (2, 4, 1)).reshape(8, 16 * 32).reshape(8, 16, 4, 8)), (T3,)),
    "reshape_heads": (lambda x: mark(x, (1, 1, 8)).reshape(8, 16, 8, 4).sum(-1), (T3,)),
    "transpose": (lambda x: jnp.transpose(mark(x, (2, 2, 2)), (2, 0, 1)) * 3.0, (T3,)),
    "broadcast_in_dim": (lambda v, a: jnp.broadcast_to(v[None, :], (32, 16)) * mark(a, (2, 4)).T, (V, A)),
    "squeeze_expand": (lambda x: jnp.squeeze(jnp.expand_dims(mark(x, (2, 4)), 1), 1) + 1.0, (A,)),
    # reductions
    "reduce_sum_split": (lambda a: jnp.sum(mark(a, (2, 4)), axis=1) * 2.0, (A,)),
    "reduce_sum_all": (lambda a: jnp.sum(mark(a, (2, 4)) ** 2), (A,)),
    "reduce_max_split": (lambda a: jnp.max(mark(a, (1, 8)), axis=1) + jnp.min(a, axis=0).sum(), (A,)),
    "mean_var": (lambda a: jnp.var(mark(a, (4, 2)), axis=0) + jnp.mean(a), (A,)),
    "softmax": (lambda a: jax.nn.softmax(mark(a, (2, 4)), axis=-1), (A,)),
    "log_softmax_vocab_split": (lambda a: jax.nn.log_softmax(mark(a, (1, 8)), axis=-1), (A,)),
    "argmax": (lambda a: jnp.argmax(mark(a, (8, 1)), axis=1), (A,)),
    "argmax_split_axis": (lambda a: jnp.argmax(mark(a, (2, 4)), axis=1), (A,)),
    "iota_onehot": (lambda a, lbl: jnp.sum(jax.nn.one_hot(lbl, 32) * mark(a, (2, 4)), axis=-1),
                    (A, rng.integers(0, 32, (16,)).astype(np.int32))),
    "iota_split": (lambda a: mark(a, (2, 4)) + jnp.arange(32, dtype=jnp.float32)[None, :], (A,)),
    # inlining
    "jit_inlined": (lambda a, b: jax.jit(lambda x, y: jnp.tanh(x @ y))(mark(a, (4, 2)), b), (A, B)),
    "custom_jvp_relu_gelu": (lambda a: jax.nn.gelu(jax.nn.relu(mark(a, (2, 4)))), (A,)),
    "custom_vjp": (lambda a: _cvjp(mark(a, (2, 4))), (A,)),
    "checkpoint": (lambda a, b: jax.checkpoint(lambda x: jnp.sin(x @ b))(mark(a, (8, 1))), (A, B)),
}


@jax.custom_vjp
def _cvjp(x):
    return jnp.sin(x)


_cvjp.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,))


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_matches_single_device(name):
    fn, args = CASES[name]
    has_float = any(np.asarray(a).dtype == np.float32 for a in args)
    out_float = all(jnp.issubdtype(s.dtype, jnp.floating) for s in jax.tree_util.tree_leaves(jax.eval_shape(fn, *args)))
    check_parallel(fn, args, grads=has_float and out_float)


def test_user_strategies_are_never_changed():
    def f(a, b):
        h = sp.shard(jnp.matmul, ((1, 8), (8, 1)))(a, b)         # contraction split
        g = sp.shard(jnp.tanh, ((8, 1),))(h)                      # wants rows
        return sp.shard(jnp.matmul, ((2, 4), (4, 1)))(g, b.T)     # and something else again
    plan = sp.parallelize(f, mesh=8).plan(A, B)
    user = [o for o in plan.ops if o.origin == "user"]
    assert [o.in_strategy for o in user] == [((1, 8), (8, 1)), ((8, 1),), ((2, 4), (4, 1))]


def test_backward_propagation_reaches_producers():
    """A strategy on the last op flows back through elementwise ops and a reshape."""
    def f(x, w):
        h = jnp.exp(x) * 2.0
        h = h.reshape(16, 32)
        return sp.shard(jnp.matmul, ((8, 1), (1, 1)))(h, w)
    x = rand(rng, 16, 4, 8)
    plan = sp.parallelize(f, mesh=8).plan(x, B)
    by_prim = {o.primitive: o for o in plan.ops}
    assert by_prim["exp"].in_strategy == ((8, 1, 1),)
    assert by_prim["exp"].origin.startswith("backward from")
    assert by_prim["reshape"].out_strategy == ((8, 1),)
    assert plan.collectives == ()  # x arrives split, nothing to move


def test_unconstrained_ops_get_the_default_and_say_so():
    def f(a, b, c):
        h = sp.shard(jnp.matmul, ((8, 1), (1, 1)))(a, b)
        return h, jnp.sin(c)  # c's chain has no neighbour with a strategy
    plan = sp.parallelize(f, mesh=8).plan(A, B, V)
    sin = next(o for o in plan.ops if o.primitive == "sin")
    assert sin.origin == "default" and sin.in_strategy == ((1,),)


def test_semi_auto_gives_data_parallel_default():
    def f(a, b):
        h = sp.shard(jnp.matmul, ((2, 4), (4, 1)))(a, b)
        return jnp.matmul(jnp.tanh(h), b.T)
    pf = check_parallel(f, (A, B), mode="semi_auto")
    ops = pf.plan(A, B).ops
    tanh = next(o for o in ops if o.primitive == "tanh")
    assert tanh.in_strategy == ((8, 1),) and tanh.origin.startswith("default")
    last = ops[-1]
    assert last.primitive == "dot_general" and last.in_strategy == ((8, 1), (1, 1))


def test_disagreement_resolved_by_fewest_bytes():
    """Two marked producers feed one add: the add follows the cheaper side to move."""
    small = rand(rng, 16, 32)

    def f(a, b):
        x = sp.shard(jnp.tanh, ((8, 1),))(a)
        y = sp.shard(jnp.tanh, ((1, 8),))(b)
        return x + y
    plan = sp.parallelize(f, mesh=8).plan(small, small)
    add = next(o for o in plan.ops if o.primitive == "add")
    # either choice moves one all_to_all of the same size; the plan must use exactly one collective
    assert [c.kind for c in plan.collectives if c.kind != "slice"] == ["all_to_all"]
    assert add.in_strategy in (((8, 1), (8, 1)), ((1, 8), (1, 8)))


def test_named_mesh_partition_spec_rules():
    def f(x, y):
        h = sp.shard(jnp.matmul, (P("dp", None, "mp"), P("dp", "mp", None)))(x, y)
        return jax.nn.softmax(h, axis=-1).sum(1)
    check_parallel(f, (T3, T3B), mesh=((2, 4), ("dp", "mp")))


def test_with_sharding_constraint_is_honoured():
    """jax's own annotation inside the function is a user strategy like shard()."""
    def f(x, w):
        h = jax.lax.with_sharding_constraint(x @ w, P("dp", "mp"))
        return jnp.tanh(h) @ w.T
    w = rand(rng, 32, 32)
    pf = sp.parallelize(f, mesh=((2, 4), ("dp", "mp")))
    tanh = next(o for o in pf.plan(A, w).ops if o.primitive == "tanh")
    assert tanh.in_strategy == ((2, 4),)
    from tests.helpers import assert_trees_close
    assert_trees_close(pf(A, w), jax.jit(lambda x, w: jnp.tanh(x @ w) @ w.T)(A, w))


def test_parallelize_out_strategy_pins_output_layouts():
    pf = sp.parallelize(lambda x: (jnp.tanh(x), x * 2.0), mesh=8, out_strategy=((8, 1), (1, 8)))
    plan = pf.plan(A)
    assert [v.layout.splits(plan.mesh) for v in plan.graph.outputs] == [(8, 1), (1, 8)]
    from tests.helpers import assert_trees_close
    assert_trees_close(pf(A), (np.tanh(A), A * 2.0), rtol=1e-6, atol=1e-6)
