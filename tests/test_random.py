"""Random numbers inside a parallelized function (issue 11, symptom 8).

The contract: a parallel program draws exactly the bits one device draws (jax's
partitionable threefry is the reference), so dropout training matches one device.
Draws are integers and compared exactly; what is computed from them to float32
rounding, forward and gradients.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax.extend.random import threefry_2x32

import shardprop as sp
from shardprop.runtime.random_bits import block_counters, random_bits_block
from tests.helpers import assert_trees_close, rand, scalarize

MESH_2x4 = ((2, 4), ("dp", "mp"))
MODES = ("sharding_propagation", "semi_auto", "data_parallel")
KEYS = {"legacy": jax.random.PRNGKey(7), "typed": jax.random.key(7)}

rng = np.random.default_rng(0)
X = rand(rng, 16, 32)
W = rand(rng, 32, 64)


def assert_same_bits(got, want):
    """Integer draws (and keys, through their data) equal bit for bit."""
    g, gt = jax.tree_util.tree_flatten_with_path(got)
    w, wt = jax.tree_util.tree_flatten(want)
    assert gt == wt
    for (path, a), b in zip(g, w):
        if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def check(fn, args, *, mesh=8, mode="sharding_propagation", grad_argnums=(), exact=False, **kw):
    """fn parallelized against jax.jit(fn) on one device, and the gradient w.r.t. grad_argnums."""
    if mode == "data_parallel":
        kw.setdefault("batch_argnums", (1,))
    pf = sp.parallelize(fn, mesh=mesh, mode=mode, verify=True, progress=False, **kw)
    (assert_same_bits if exact else assert_trees_close)(pf(*args), jax.jit(fn)(*args))
    if grad_argnums:
        g = jax.grad(scalarize(fn, args), argnums=grad_argnums)
        assert_trees_close(sp.parallelize(g, mesh=mesh, mode=mode, verify=True, **kw)(*args), jax.jit(g)(*args))
    return pf


# -- the issue's repro -----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["legacy", "typed"])
@pytest.mark.slow
def test_issue_repro_bernoulli_data_parallel(kind):
    f = lambda k, x: x * jax.random.bernoulli(k, .9, x.shape)  # noqa: E731
    check(f, (KEYS[kind], X), mode="data_parallel", grad_argnums=(1,))


# -- every jax.random path, legacy and typed keys, every mode, two meshes ---------------
# Every draw of a table is one output of one program (a threefry draw takes a second or
# two to compile on CPU), and the one-device results are worked out once per key kind.
DRAWS = {
    "bits": lambda k, x: jax.random.bits(k, x.shape),
    "bits_u8": lambda k, x: jax.random.bits(k, x.shape, jnp.uint8),
    "bernoulli": lambda k, x: jax.random.bernoulli(k, .7, x.shape),
    "split": lambda k, x: jax.random.split(k, 5),
    "fold_in": lambda k, x: jax.random.bits(jax.random.fold_in(k, 11), x.shape),
    "seed_inside": lambda k, x: jax.random.bits(jax.random.PRNGKey(3), x.shape),
    "typed_seed_inside": lambda k, x: jax.random.bits(jax.random.key(3), (4, 8, 2)),
    "permutation": lambda k, x: jax.random.permutation(k, x.shape[0]),
    "per_row_keys": lambda k, x: jax.vmap(lambda kk: jax.random.bits(kk, x.shape[1:]))(
        jax.random.split(k, x.shape[0])),
    "threefry_2x32": lambda k, x: threefry_2x32(_key_data(k), jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape)),
    "key_data": lambda k, x: _key_data(jax.random.clone(jax.random.wrap_key_data(_key_data(k)))),
}
FLOAT_DRAWS = {
    "dropout": lambda k, x: jnp.where(jax.random.bernoulli(k, .8, x.shape), x / .8, 0.),
    "normal": lambda k, x: x * jax.random.normal(k, x.shape),
    "uniform": lambda k, x: x + jax.random.uniform(k, x.shape, minval=-1.),
    "split_normal": lambda k, x: x * jax.random.normal(jax.random.split(k)[1], x.shape),
    "seed_inside": lambda k, x: x * jax.random.normal(jax.random.PRNGKey(0), x.shape),
    "3d": lambda k, x: jnp.sum(x.reshape(4, 4, 32) * jax.random.normal(k, (4, 4, 32)), 1),
}


def _key_data(k):
    return k if k.dtype == jnp.uint32 else jax.random.key_data(k)


def _draws(k, x):
    return {name: fn(k, x) for name, fn in DRAWS.items()}


def _values_and_grads(k, x):
    """Every float draw, and the gradient w.r.t. x of a random projection of them all."""
    fn = lambda k, x: {name: f(k, x) for name, f in FLOAT_DRAWS.items()}  # noqa: E731
    return fn(k, x), jax.grad(scalarize(fn, (k, x)), argnums=1)(k, x)


_ONE_DEVICE: dict = {}


def one_device(fn, kind):
    if (fn, kind) not in _ONE_DEVICE:
        _ONE_DEVICE[fn, kind] = jax.jit(fn)(KEYS[kind], X)
    return _ONE_DEVICE[fn, kind]


# each mode on both meshes, each key kind on both meshes
COMBOS = [("legacy", "sharding_propagation", 8), ("typed", "semi_auto", 8), ("typed", "data_parallel", 8),
          ("typed", "sharding_propagation", MESH_2x4), ("legacy", "semi_auto", MESH_2x4),
          ("legacy", "data_parallel", MESH_2x4)]
COMBO_IDS = [f"{k}-{m}-{'mesh8' if n == 8 else 'mesh2x4'}" for k, m, n in COMBOS]


@pytest.mark.parametrize("kind,mode,mesh", COMBOS, ids=COMBO_IDS)
@pytest.mark.slow
def test_draws_equal_one_device_exactly(kind, mode, mesh):
    pf = sp.parallelize(_draws, mesh=mesh, mode=mode, verify=True, progress=False)
    assert_same_bits(pf(KEYS[kind], X), one_device(_draws, kind))


@pytest.mark.parametrize("kind,mode,mesh", COMBOS, ids=COMBO_IDS)
@pytest.mark.slow
def test_random_values_and_grads(kind, mode, mesh):
    pf = sp.parallelize(_values_and_grads, mesh=mesh, mode=mode, verify=True, progress=False)
    assert_trees_close(pf(KEYS[kind], X), one_device(_values_and_grads, kind))


@pytest.mark.slow
def test_gamma():
    """random_gamma splits its key per element by position: those dims stay whole."""
    check(lambda k, x: x * jax.random.gamma(k, 2., x.shape), (KEYS["typed"], X[:8, :4]), mode="data_parallel")


@pytest.mark.slow
def test_key_closed_over_and_returned():
    """A key array the function closes over is fed in; keys come back as keys."""
    outside = jax.random.split(jax.random.key(5), 4)

    def f(k, x):
        k1, k2 = jax.random.split(k)
        return k1, x * jax.random.normal(outside[2], x.shape) + jax.random.uniform(k2, x.shape)
    got, want = sp.parallelize(f, mesh=8, verify=True)(KEYS["typed"], X), jax.jit(f)(KEYS["typed"], X)
    assert_same_bits(got[0], want[0])
    assert_trees_close(got[1], want[1])


def test_key_carried_through_scan():
    xs = rand(rng, 4, 16, 8)

    def f(k, xs):
        def body(c, x):
            k, acc = c
            k, sub = jax.random.split(k)
            return (k, acc + x * jax.random.normal(sub, x.shape)), None
        return jax.lax.scan(body, (k, jnp.zeros(xs.shape[1:])), xs)[0]
    pf = sp.parallelize(f, mesh=8, in_strategy=(None, (1, 8, 1)))
    got, want = pf(KEYS["typed"], xs), jax.jit(f)(KEYS["typed"], xs)
    assert_same_bits(got[0], want[0])
    assert_trees_close(got[1], want[1])


# -- the bits' layout split by a neighbour: each device draws only its block -------------
def _marked_dropout_net(k, x, w):
    h = sp.shard(jnp.matmul, ((2, 1), (1, 4)))(x, w)      # output split (2, 4)
    h = jnp.where(jax.random.bernoulli(k, .8, h.shape), h / .8, 0.)
    return jnp.mean(jnp.tanh(h) ** 2)


@pytest.mark.parametrize("mode", ["sharding_propagation", "semi_auto"])
@pytest.mark.parametrize("kind", ["legacy", "typed"])
@pytest.mark.slow
def test_dropout_after_a_marked_matmul(kind, mode):
    vg = jax.value_and_grad(_marked_dropout_net, argnums=(1, 2))
    pf = sp.parallelize(vg, mesh=8, mode=mode, verify=True)
    assert_trees_close(pf(KEYS[kind], X, W), jax.jit(vg)(KEYS[kind], X, W))
    bits = next(o for o in pf.plan(KEYS[kind], X, W).ops if o.primitive == "random_bits")
    assert np.prod(bits.out_strategy[0]) == 8    # every device draws an eighth of the mask


@pytest.mark.slow
def test_dropout_after_a_marked_matmul_named_mesh():
    def net(k, x, w):
        h = sp.shard(jnp.matmul, (P("dp", None), P(None, "mp")))(x, w)
        return jnp.where(jax.random.bernoulli(k, .5, h.shape), h, 0.)
    pf = check(net, (KEYS["typed"], X, W), mesh=MESH_2x4, grad_argnums=(1, 2))
    bits = next(o for o in pf.plan(KEYS["typed"], X, W).ops if o.primitive == "random_bits")
    assert bits.out_strategy == ((2, 4),)


@pytest.mark.slow
def test_batch_of_keys_with_split_draws():
    """vmap over per-row keys (flax's per-example dropout): the key batch dim and the drawn
    dim are both split; each device draws its block with its own rows' keys."""
    def f(k, x):
        x = sp.shard(jnp.tanh, ((2, 4),))(x)
        return jax.vmap(lambda kk, xx: xx * jax.random.normal(kk, xx.shape))(jax.random.split(k, x.shape[0]), x)
    pf = check(f, (KEYS["typed"], X), grad_argnums=(1,))
    bits = next(o for o in pf.plan(KEYS["typed"], X).ops if o.primitive == "random_bits")
    assert bits.out_strategy == ((2, 4),) and bits.in_strategy == ((2,),)


def test_split_draw_has_no_collective_and_local_shape():
    """A draw split over every device is drawn in blocks: no all_gather, and every
    rank's program draws an eighth."""
    f = lambda k, x: x * jax.random.normal(k, x.shape)  # noqa: E731
    pf = sp.parallelize(f, mesh=8, mode="data_parallel")
    plan = pf.plan(KEYS["typed"], X)
    assert not plan.collectives
    bits = next(o for o in plan.ops if o.primitive == "random_bits")
    assert bits.out_strategy == ((8, 1),)
    assert_trees_close(pf(KEYS["typed"], X), jax.jit(f)(KEYS["typed"], X))


def test_original_threefry_keeps_the_draw_whole():
    """With jax_threefry_partitionable off, bits depend on the whole shape: every device
    draws all of it and takes its block; still equal to one device."""
    f = lambda k, x: jax.random.bits(k, x.shape)  # noqa: E731
    before = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", False)
    try:
        pf = sp.parallelize(f, mesh=8, mode="data_parallel")
        bits = next(o for o in pf.plan(KEYS["typed"], X).ops if o.primitive == "random_bits")
        assert bits.out_strategy == ((1, 1),)
        assert_same_bits(pf(KEYS["typed"], X), jax.jit(f)(KEYS["typed"], X))
    finally:
        jax.config.update("jax_threefry_partitionable", before)


def test_other_prng_implementations_keep_the_draw_whole():
    key = jax.random.key(3, impl="rbg")
    f = lambda k, x: x * jax.random.uniform(k, x.shape)  # noqa: E731
    pf = check(f, (key, X), mode="data_parallel", grad_argnums=(1,))
    bits = next(o for o in pf.plan(key, X).ops if o.primitive == "random_bits")
    assert bits.out_strategy == ((1, 1),)


# -- the block lowering against numpy and jax ---------------------------------------------
@pytest.mark.parametrize("shape,block,offsets", [
    ((64, 16), (8, 4), (16, 12)),
    ((5, 7, 3), (5, 7, 3), (0, 0, 0)),
    ((2 ** 20, 2 ** 13, 3), (4, 5, 3), (2 ** 20 - 4, 2 ** 13 - 5, 0)),      # counters beyond 2**32
    ((3, 2 ** 31 - 1, 5), (3, 4, 5), (0, 2 ** 31 - 5, 0)),
])
def test_block_counters_are_global_positions(shape, block, offsets):
    strides = [int(np.prod(shape[d + 1:], dtype=object)) for d in range(len(shape))]
    grids = np.meshgrid(*[np.arange(o, o + b, dtype=object) for o, b in zip(offsets, block)], indexing="ij")
    want = sum(g * s for g, s in zip(grids, strides)) % 2 ** 64
    hi, lo = jax.jit(lambda o: block_counters(shape, block, o))(jnp.asarray(offsets, jnp.int32))
    np.testing.assert_array_equal(np.asarray(hi), (want >> 32).astype(np.uint64))
    np.testing.assert_array_equal(np.asarray(lo), (want & 0xFFFFFFFF).astype(np.uint64))


@pytest.mark.slow
def test_block_is_the_block_of_the_global_draw():
    key = jax.random.key(5)
    keys = jax.random.split(key, 4)
    widths = (8, 16, 32)

    @jax.jit
    def draws(key, keys):
        out = {}
        for w in widths:
            dtype = np.dtype(f"uint{w}")
            out[w] = (jax.random.bits(key, (12, 10), dtype), random_bits_block(key, w, (12, 10), (3, 5), (6, 5)),
                      jax.random.bits(key, (3, 5), dtype),
                      jax.vmap(lambda k: jax.random.bits(k, (12, 10), dtype))(keys),
                      random_bits_block(keys, w, (12, 10), (12, 5), (0, 5)))
        return out
    for w, arrays in draws(key, keys).items():
        full, block, local, batched, batched_block = map(np.asarray, arrays)
        np.testing.assert_array_equal(block, full[6:9, 5:10], err_msg=f"uint{w}")
        # a local-shaped draw numbers its elements from 0: other bits, which is why blocks need offsets
        assert not np.array_equal(local, full[6:9, 5:10])
        np.testing.assert_array_equal(batched_block, batched[:, :, 5:], err_msg=f"uint{w}")
