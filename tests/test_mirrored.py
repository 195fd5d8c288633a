"""OneFlow's mirrored view: ``jax.shard_map`` (per-device code with the user's own
collectives) inside a parallelized function, next to the global view of ``shard()``
marks. Its in_specs/out_specs are fixed layouts at its boundary; its body runs as
written."""
import inspect
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import shardprop as sp
from tests.helpers import assert_trees_close, check_parallel, scalarize

NAMED = ((2, 4), ("dp", "mp"))
rng = np.random.default_rng(0)
X = rng.standard_normal((16, 32)).astype(np.float32)
W1 = (rng.standard_normal((32, 64)) * 0.2).astype(np.float32)
W2 = (rng.standard_normal((64, 32)) * 0.2).astype(np.float32)


def jax_mesh(shape, names):
    devices = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


MESH = jax_mesh(*NAMED)


# -- one model, two views ----------------------------------------------------------

def global_view(x, w1, w2):
    """Megatron's MLP from marks: batch over dp, the hidden dim over mp; the rest is derived."""
    h = sp.shard(jnp.matmul, (P("dp", None), P(None, "mp")))(x, w1)
    return jnp.tanh(jax.nn.relu(h) @ w2)


def mlp_block(x, w1, w2):
    """The same MLP on one device's blocks: x (B/dp, D), w1 (D, H/mp), w2 (H/mp, D)."""
    return lax.psum(jax.nn.relu(x @ w1) @ w2, "mp")


def mirrored_view(x, w1, w2):
    y = jax.shard_map(mlp_block, mesh=MESH, in_specs=(P("dp", None), P(None, "mp"), P("mp", None)),
                      out_specs=P("dp", None))(x, w1, w2)
    return jnp.tanh(y)


@pytest.mark.slow
def test_global_and_mirrored_views_agree_with_one_device():
    args = (X, W1, W2)
    single = jax.jit(global_view)(*args)
    glob = check_parallel(global_view, args, mesh=NAMED)
    mirr = check_parallel(mirrored_view, args, mesh=NAMED)
    assert_trees_close(glob(*args), single)
    assert_trees_close(mirr(*args), single)
    # gradients of the two views agree too (check_parallel held each to one device)
    grads = [sp.parallelize(jax.grad(scalarize(f, args), argnums=(0, 1, 2)), mesh=NAMED)(*args)
             for f in (global_view, mirrored_view)]
    assert_trees_close(grads[0], grads[1])
    # the global view's reduction over mp is derived (the planner picks its form); the
    # mirrored view's is the user's psum, so the compiler adds nothing around the shard_map
    derived = glob.plan(*args).collectives
    assert len(derived) == 1 and derived[0].kind in ("all_reduce", "reduce_scatter") and derived[0].axes == ("mp",)
    plan = mirr.plan(*args)
    assert plan.collectives == ()
    op = next(o for o in plan.ops if o.primitive == "shard_map")
    assert op.in_strategy == ((2, 1), (1, 4), (4, 1)) and op.out_strategy == ((2, 1),)
    assert op.origin == "user (shard_map in_specs/out_specs)"
    # what follows takes the shard_map's out_specs layout without being told
    assert next(o for o in plan.ops if o.primitive == "tanh").in_strategy == ((2, 1),)


def test_training_step_through_shard_map():
    """value_and_grad of a loss that runs through a shard_map, and an SGD update: jax
    transposes the body into a second shard_map, which parallelizes like the first."""
    def step(params, x):
        def loss(p):
            return jnp.mean(mirrored_view(x, *p) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), value
    params = (W1, W2)
    pstep = sp.parallelize(step, mesh=NAMED, verify=True)
    got, want = (params, None), (params, None)
    for _ in range(3):
        got = pstep(got[0], X)
        want = jax.jit(step)(want[0], X)
        assert_trees_close(got, want)
    assert [o.primitive for o in pstep.plan(params, X).ops].count("shard_map") == 2


# -- planned around ------------------------------------------------------------------

def test_operand_in_another_layout_is_redistributed_before_the_shard_map():
    line = []

    def f(x, w1, w2):
        h = sp.shard(jnp.tanh, (P("mp", "dp"),))(x)    # arrives split [mp, dp]: not what in_specs ask
        line.append(inspect.currentframe().f_lineno + 1)
        y = jax.shard_map(mlp_block, mesh=MESH, in_specs=(P("dp", None), P(None, "mp"), P("mp", None)),
                          out_specs=P("dp", None))(h, w1, w2)
        return jnp.sin(y)
    pf = check_parallel(f, (X, W1, W2), mesh=NAMED)
    plan = pf.plan(X, W1, W2)
    before = [c for c in plan.collectives if c.reason == f"for shard_map at test_mirrored.py:{line[0]}"]
    assert before, [(c.kind, c.reason) for c in plan.collectives]
    assert before[-1].out_shape == (8, 32)   # the block in_specs P("dp", None) gives each device
    tanh = next(o for o in plan.ops if o.primitive == "tanh")
    assert tanh.out_strategy == ((4, 2),)    # the user's mark is kept; the planner adapts after it


def test_loops_constants_and_jit_in_the_body():
    """The body's own scan (a psum inside it), a jitted helper, an array it closes over."""
    bias = np.linspace(-1, 1, 32).astype(np.float32)

    @jax.jit
    def layer(h, w):
        return jax.nn.gelu(h @ w + bias)

    def body(x, w):
        def step(h, _):
            return lax.psum(layer(h, w), "mp") / 4, jnp.sum(h)
        h, sums = lax.scan(step, x, None, length=3)
        return h, lax.psum(sums, "dp")

    def f(x, w):
        h, sums = jax.shard_map(body, mesh=MESH, in_specs=(P("dp"), P()), out_specs=(P("dp"), P()))(x, w)
        return h * jnp.sum(sums)
    check_parallel(f, (X, W2[:32]), mesh=NAMED)


def test_shard_map_in_a_scanned_layer_and_without_vma_checks():
    def f(x, w):
        def layer(h, _):
            y = jax.shard_map(lambda a, b: lax.psum(a @ b, "mp"), mesh=MESH, in_specs=(P("dp", "mp"), P("mp")),
                              out_specs=P("dp"), check_vma=False)(h, w)
            return jnp.tanh(y), None
        return lax.scan(layer, x, None, length=2)[0]
    check_parallel(f, (X, W2[:32]), mesh=NAMED)


def test_device_count_mesh_binds_the_users_axes_to_runs_of_its_axes(tmp_path):
    """With mesh=8 the program's axes are d0, d1, d2 (2 each): the shard_map's axes
    a (2) and b (4) stand for d0 and d1,d2, and its collectives are renamed so."""
    mesh = jax_mesh((2, 4), ("a", "b"))

    def f(x, w1, w2):
        def block(x, w1, w2):
            offset = lax.axis_index("b").astype(jnp.float32)   # which hidden block this device holds
            return lax.psum(jax.nn.relu(x @ w1 + offset) @ w2, "b")
        return jax.shard_map(block, mesh=mesh, in_specs=(P("a"), P(None, "b"), P("b")), out_specs=P("a"))(x, w1, w2)
    pf = check_parallel(f, (X, W1, W2), mesh=8, dump_dir=str(tmp_path))
    assert pf.plan(X, W1, W2).ops[0].in_strategy == ((2, 1), (1, 4), (4, 1))
    rank5 = (tmp_path / "rank_5" / "execute.ir").read_text()
    assert "axis_index() {axis_name=(d1, d2), group_ranks=4-5-6-7}" in rank5
    assert "psum(" in rank5 and "{axes=(d1, d2), group_ranks=4-5-6-7}" in rank5


def test_size_one_axis_of_the_parallelize_mesh_keeps_its_name():
    mesh = jax_mesh((1, 8), ("a", "x"))

    def f(x):
        def body(v):
            return lax.psum(v * (lax.axis_index("a") + 1), ("a", "x"))
        return jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())(x)
    check_parallel(f, (X,), mesh=mesh)


# -- dumps ---------------------------------------------------------------------------

def test_per_rank_dump_shows_the_body(tmp_path):
    pf = sp.parallelize(mirrored_view, mesh=NAMED, dump_dir=str(tmp_path))
    pf(X, W1, W2)
    text = (tmp_path / "rank_6" / "execute.ir").read_text()   # coords dp=1 mp=2
    op_line = next(i for i, l in enumerate(text.splitlines()) if " = shard_map(" in l)
    lines = text.splitlines()[op_line:]
    assert "in_specs=([{dp}, {}], [{}, {mp}], [{mp}, {}])" in lines[0] and "-> f32[8,32]" in lines[0]
    body = lines[lines.index("  per-device body {"):]
    body = body[:body.index("  }") + 1]
    assert "body_input[1] : f32[32,16]" in "\n".join(body)   # w1's block on this device
    ops = [l.split(" = ")[1].split("(")[0] for l in body if " = " in l and "body_input" not in l]
    assert ops == ["dot_general", "max", "dot_general", "psum"]   # relu is max(x, 0)
    assert any("psum(" in l and "{axes=(mp,), group_ranks=4-5-6-7}" in l for l in body)
    assert any("source=test_mirrored.py:" in l for l in body)   # the body's lines are the user's
    # the global dump shows the same body, on per-device shapes
    assert "per-device body {" in (tmp_path / "02_propagate-sharding.ir").read_text()


# -- errors --------------------------------------------------------------------------

def _call_line(fn) -> int:
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, l in enumerate(src) if "jax.shard_map(" in l)


def test_mesh_axis_the_parallelize_mesh_lacks_is_a_sharding_error():
    """jax checks a shard_map against the mesh it is traced under (the parallelize mesh):
    its complaint comes back as a ShardingError that names the call's line."""
    other = jax_mesh((2, 4), ("dp", "tp"))

    def f(x, w):
        return jax.shard_map(lambda a, b: lax.psum(a @ b, "tp"), mesh=other, in_specs=(P("dp", "tp"), P("tp")),
                             out_specs=P("dp"))(x, w)
    with pytest.raises(sp.ShardingError) as e:
        sp.parallelize(f, mesh=NAMED)(X, W2[:32])
    msg = str(e.value)
    assert msg.startswith(f"shard_map at test_mirrored.py:{_call_line(f)}: ")
    assert "'tp': 4" in msg and "'mp': 4" in msg and "runs on the parallelize mesh (omit mesh=" in msg


def test_spec_naming_an_axis_the_mesh_lacks_is_a_sharding_error():
    def f(x):
        return jax.shard_map(jnp.sin, mesh=MESH, in_specs=P("tp"), out_specs=P("dp"))(x)
    with pytest.raises(sp.ShardingError) as e:
        sp.parallelize(f, mesh=NAMED)(X)
    msg = str(e.value)
    assert msg.startswith(f"shard_map at test_mirrored.py:{_call_line(f)}: shard_map in_specs argument must refer "
                          "to an axis marked as manual")
    assert "in_specs refers to 'tp'" in msg.splitlines()[0] and "fix:" in msg


def test_mesh_that_does_not_fit_a_device_count_is_a_sharding_error():
    three = jax_mesh((3,), ("x",))

    def f(x):
        return jax.shard_map(jnp.sin, mesh=three, in_specs=P(None, "x"), out_specs=P(None, "x"))(x[:, :30])
    with pytest.raises(sp.ShardingError, match=r"does not map onto the 8 devices' axes"):
        sp.parallelize(f, mesh=8)(X)


def test_shard_mark_inside_the_body_is_a_sharding_error():
    def f(x, w):
        def body(a, b):
            return sp.shard(jnp.matmul, ((2, 1), (1, 1)))(a, b)
        return jax.shard_map(body, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P("dp"))(x, w)
    with pytest.raises(sp.ShardingError, match="inside a shard_map body: the body is per-device code"):
        sp.parallelize(f, mesh=NAMED)(X, W2[:32])


# -- the example -----------------------------------------------------------------------

def test_example_shows_both_views_agree(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import mirrored_view as example
    example.main()
    out = capsys.readouterr().out
    assert "global view and mirrored view agree" in out
