"""Dropout training of models written by others, unchanged (issue 11): the dropout
key is made inside the training step, as model code does, and the parallel run's
losses equal one device's step by step (the masks are the same bits)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shardprop as sp
from tests.helpers import assert_trees_close

flax = pytest.importorskip("flax", reason="flax is in the test extra; install it with pip install -e '.[test]'")
import flax.linen as nn  # noqa: E402

MESH_2x4 = ((2, 4), ("dp", "mp"))
STEPS = 3


def train(step, state, batches, **parallel):
    """Losses of a step run for a few batches, parallelized if options are given, else jit."""
    run = sp.parallelize(step, progress=False, **parallel) if parallel else jax.jit(step)
    losses = []
    for batch in batches:
        *state, loss = run(*state, *batch)
        losses.append(float(loss))
    return losses, state


def assert_same_training(step, state, batches, **parallel):
    """Losses to float32 rounding, and the trained weights. (SGD: Adam would divide the
    rounding noise of gradients that are zero in exact arithmetic, like an attention key
    bias's, by its own size and turn it into full-size updates.)"""
    want, want_state = train(step, state, batches)
    got, got_state = train(step, state, batches, **parallel)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len(set(want)) == len(want)     # the steps differ: new masks, updated weights
    key_data = lambda t: jax.tree_util.tree_map(  # noqa: E731  (keys compare through their data)
        lambda a: jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a, t)
    assert_trees_close(key_data(got_state), key_data(want_state), rtol=1e-4, atol=1e-5)
    return got


# -- flax linen ---------------------------------------------------------------------------
class Block(nn.Module):
    """Attention and MLP with the dropouts of a transformer block (attention weights,
    residual, and a dropout broadcast over the sequence)."""
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=4, dropout_rate=0.1, broadcast_dropout=False,
                                            deterministic=not train)(h, h)
        x = x + nn.Dropout(0.2)(h, deterministic=not train)
        h = nn.gelu(nn.Dense(64, name="up")(nn.LayerNorm()(x)))
        h = nn.Dropout(0.3, broadcast_dims=(1,))(h, deterministic=not train)
        return x + nn.Dense(16, name="down")(h)


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = Block()(nn.Dense(16)(x), train)
        return nn.Dense(4)(jnp.mean(x, axis=1))


def _linen_setup():
    model, opt = Classifier(), optax.sgd(0.1, momentum=0.9)
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((8, 6, 12)).astype(np.float32), rng.integers(0, 4, 8).astype(np.int32))
               for _ in range(STEPS)]
    params = model.init(jax.random.key(0), batches[0][0], train=False)

    def step(params, opt_state, key, x, y):
        key, dropout = jax.random.split(key)          # the key is state: the next step gets a fresh one
        def loss(p):
            logits = model.apply(p, x, train=True, rngs={"dropout": dropout})
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key, value
    return step, (params, opt.init(params), jax.random.key(42)), batches


@pytest.mark.slow
def test_flax_linen_dropout_training_data_parallel():
    step, state, batches = _linen_setup()
    assert_same_training(step, state, batches, mesh=8, mode="data_parallel", batch_argnums=(3, 4))


@pytest.mark.slow
def test_flax_linen_dropout_training_megatron():
    """The MLP's up-projection column-split and its down-projection row-split over mp, the
    batch over dp: the dropout mask between them is drawn in blocks on both axes."""
    step, state, batches = _linen_setup()
    params = state[0]
    strategy = jax.tree_util.tree_map(lambda _: None, params)
    block = strategy["params"]["Block_0"]
    block["up"] = {"kernel": P(None, "mp"), "bias": P("mp")}
    block["down"] = {"kernel": P("mp", None), "bias": None}
    pf = sp.parallelize(step, mesh=MESH_2x4, in_strategy=(strategy, None, None, P("dp"), P("dp")),
                        progress=False)
    plan = pf.plan(*state, *batches[0])
    masks = [o for o in plan.ops if o.primitive == "random_bits" and o.out_strategy[0] == (2, 1, 4)]
    assert masks, "the MLP dropout mask is not drawn split over dp and mp"
    assert_same_training(step, state, batches, mesh=MESH_2x4,
                         in_strategy=(strategy, None, None, P("dp"), P("dp")))


# -- flax nnx: the dropout key and its counter are model state ----------------------------
@pytest.mark.slow
def test_flax_nnx_dropout_training_data_parallel():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(12, 64, rngs=rngs), nnx.Linear(64, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)

        def __call__(self, x):
            return self.down(self.drop(nnx.gelu(self.up(x))))
    graphdef, state = nnx.split(MLP(nnx.Rngs(0, dropout=1)))
    opt = optax.sgd(0.1, momentum=0.9)
    rng = np.random.default_rng(2)
    batches = [(rng.standard_normal((16, 12)).astype(np.float32),) for _ in range(STEPS)]

    def step(state, opt_state, x):
        model = nnx.merge(graphdef, state)      # draws advance the model's own rng counter
        value, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        params = nnx.state(model, nnx.Param)
        updates, opt_state = opt.update(grads, opt_state, params)
        nnx.update(model, optax.apply_updates(params, updates))
        return nnx.state(model), opt_state, value
    params = nnx.state(nnx.merge(graphdef, state), nnx.Param)
    assert_same_training(step, (state, opt.init(params)), batches, mesh=8, mode="data_parallel")


# -- Hugging Face -------------------------------------------------------------------------
def _flax_gpt2():
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
        pytest.skip(f"transformers {transformers.__version__} has no Flax models (removed in 5.0): "
                    "pip install 'transformers>=4.57,<5'")
    return transformers.GPT2Config, transformers.FlaxGPT2LMHeadModel


def _gpt2_setup():
    GPT2Config, FlaxGPT2LMHeadModel = _flax_gpt2()
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = FlaxGPT2LMHeadModel(cfg, seed=0)      # built from the config: no weights downloaded
    opt = optax.sgd(0.1, momentum=0.9)
    rng = np.random.default_rng(1)
    batches = [(rng.integers(0, 64, (8, 16)).astype(np.int32),) for _ in range(STEPS)]

    def step(params, opt_state, key, ids):
        key, dropout = jax.random.split(key)
        def loss(p):
            logits = model(ids, params=p, dropout_rng=dropout, train=True).logits
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key, value
    return step, (model.params, opt.init(model.params), jax.random.PRNGKey(7)), batches


@pytest.mark.slow
def test_hf_flax_gpt2_dropout_training_data_parallel():
    step, state, batches = _gpt2_setup()
    assert_same_training(step, state, batches, mesh=8, mode="data_parallel")
