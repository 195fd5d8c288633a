"""Megatron plans from two annotations per layer (QKV heads, first MLP matmul
columns): exactly one all_reduce per attention block and per MLP block forward,
their conjugates backward, no weight gathered; on dp x mp, the tensor-parallel
reductions stay inside mp groups and gradients are reduced over dp only."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardprop as sp
from tests.helpers import assert_trees_close

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt_megatron as M  # noqa: E402

CFG = M.Config(layers=2)
PARAMS = M.init_params(CFG)
TOKENS, TARGETS = M.make_batch(CFG)
ACTIVATION = (CFG.batch, CFG.seq, CFG.embed)


def test_forward_one_all_reduce_per_block():
    par = M.Parallelism.tensor(8)
    plan = sp.parallelize(lambda p, t: M.forward(p, t, par, CFG), mesh=8).plan(PARAMS, TOKENS)
    kinds = [(c.kind, c.in_shape) for c in plan.collectives]
    assert kinds == [("all_reduce", ACTIVATION)] * (2 * CFG.layers)


@pytest.mark.slow
def test_training_step_is_megatron():
    step, opt = M.make_train_step(M.Parallelism.tensor(8), CFG)
    state = opt.init(PARAMS)
    pstep = sp.parallelize(step, mesh=8)
    plan = pstep.plan(PARAMS, state, TOKENS, TARGETS)
    # 2 forward + 2 backward all_reduces per layer, of the activation, and nothing else
    assert [(c.kind, c.in_shape) for c in plan.collectives] == [("all_reduce", ACTIVATION)] * (4 * CFG.layers)
    # weights stay split the Megatron way (inputs arrive split, no gather)
    layouts = {name: v.layout.splits(plan.mesh) for name, v in zip(plan.graph.input_names, plan.graph.inputs)}
    assert layouts["params['layers'][0]['wq']"] == (1, 8, 1)
    assert layouts["params['layers'][0]['wo']"] == (8, 1)
    assert layouts["params['layers'][0]['w1']"] == (1, 8)
    assert layouts["params['layers'][0]['w2']"] == (8, 1)
    # and the step computes what one device computes
    got = pstep(PARAMS, state, TOKENS, TARGETS)
    want = jax.jit(step)(PARAMS, state, TOKENS, TARGETS)
    assert_trees_close(got, want)


@pytest.mark.slow
def test_data_and_tensor_parallel_2x4():
    step, opt = M.make_train_step(M.Parallelism.data_and_tensor(), CFG)
    state = opt.init(PARAMS)
    pstep = sp.parallelize(step, mesh=((2, 4), ("dp", "mp")), donate_argnums=(0, 1))
    plan = pstep.plan(PARAMS, state, TOKENS, TARGETS)
    mp_groups, dp_groups = ((0, 1, 2, 3), (4, 5, 6, 7)), ((0, 4), (1, 5), (2, 6), (3, 7))
    tp = [c for c in plan.collectives if c.groups == mp_groups]
    dp = [c for c in plan.collectives if c.groups == dp_groups]
    assert len(tp) + len(dp) == len(plan.collectives)       # nothing over the whole mesh
    # tensor parallelism: the Megatron all_reduces, of the dp-local activation, inside mp groups
    assert [(c.kind, c.in_shape) for c in tp] == [("all_reduce", (CFG.batch // 2, CFG.seq, CFG.embed))] * (
        4 * CFG.layers)
    # data parallelism as DDP does it: each gradient all-reduced over dp once (and the loss);
    # the state comes back as it went in, so no gradient is scattered only to gather the
    # updated parameter back at the end
    assert [c.kind for c in dp] == ["all_reduce"] * (len(jax.tree_util.tree_leaves(PARAMS)) + 1)
    # the new params and optimizer state come back in the layouts they went in
    g = plan.graph
    for out_index, in_index in g.tied_outputs.items():
        assert g.outputs[out_index].layout == g.inputs[in_index].layout
    assert len(g.tied_outputs) == len(jax.tree_util.tree_leaves((PARAMS, state)))
    want = jax.jit(step)(PARAMS, state, TOKENS, TARGETS)
    assert_trees_close(pstep(PARAMS, state, TOKENS, TARGETS), want)   # donates (a copy of) state


@pytest.mark.slow
def test_sequence_parallel_forward_gathers_and_scatters():
    """Marking the layer norms (sequence split) and the row-parallel matmuls' outputs turns
    each block's all_reduce into an all_gather before it and a reduce_scatter after it."""
    par = M.Parallelism.sequence(8)
    pf = sp.parallelize(lambda p, t: M.forward(p, t, par, CFG), mesh=8)
    plan = pf.plan(PARAMS, TOKENS)
    local_seq = (CFG.batch, CFG.seq // 8, CFG.embed)
    assert [(c.kind, c.in_shape) for c in plan.collectives] == [
        ("all_gather", local_seq), ("reduce_scatter", ACTIVATION)] * (2 * CFG.layers)
    assert_trees_close(pf(PARAMS, TOKENS), jax.jit(lambda p, t: M.forward(p, t, par, CFG))(PARAMS, TOKENS))


@pytest.mark.slow
def test_sequence_parallel_backward_is_the_conjugate():
    """Backward, each block gathers its incoming gradient once (the weight gradient
    and the input gradient both read the gathered copy) and reduce-scatters the
    input gradient: no weight is gathered, nothing changes layout by all_to_all."""
    step, opt = M.make_train_step(M.Parallelism.sequence(8), CFG)
    plan = sp.parallelize(step, mesh=8).plan(PARAMS, opt.init(PARAMS), TOKENS, TARGETS)
    local_seq = (CFG.batch, CFG.seq // 8, CFG.embed)
    activations = [(c.kind, c.in_shape) for c in plan.collectives if c.in_shape in (local_seq, ACTIVATION)]
    assert activations == [("all_gather", local_seq), ("reduce_scatter", ACTIVATION)] * (4 * CFG.layers)
    kinds = [c.kind for c in plan.collectives]
    assert "all_to_all" not in kinds and kinds.count("all_gather") == 4 * CFG.layers


@pytest.mark.slow
def test_sequence_parallel_training_step_equals_single_device():
    step, opt = M.make_train_step(M.Parallelism.sequence(8), CFG)
    state = opt.init(PARAMS)
    pstep = sp.parallelize(step, mesh=8, donate_argnums=(0, 1))
    want = jax.jit(step)(PARAMS, state, TOKENS, TARGETS)
    assert_trees_close(pstep(PARAMS, state, TOKENS, TARGETS), want)


# -- post-LN (BERT) and fused-QKV (GPT-2) layers, with the same two marks per layer ------------
def post_ln_forward(params, tokens, par, cfg):
    """BERT's order: each block's residual sum is normalized after it (x = LN(x + f(x)))."""
    x = jax.nn.one_hot(tokens, cfg.vocab, dtype=jnp.float32) @ params["wte"] + params["wpe"]
    b, s, e = x.shape
    project = sp.shard(lambda a, w: jnp.einsum("bse,ehd->bshd", a, w), par.heads)
    for p in params["layers"]:
        q, k, v = project(x, p["wq"]), project(x, p["wk"]), project(x, p["wv"])
        weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(cfg.head_dim), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, e)
        x = M.layer_norm(x + out @ p["wo"], p["ln1_g"], p["ln1_b"])
        h = sp.shard(jnp.matmul, par.columns)(x, p["w1"])
        x = M.layer_norm(x + jax.nn.gelu(h) @ p["w2"], p["ln2_g"], p["ln2_b"])
    return x @ params["wte"].T


def fused_qkv_forward(params, tokens, par, cfg):
    """GPT-2's attention: one column-split projection to [q|k|v], split, then heads."""
    x = jax.nn.one_hot(tokens, cfg.vocab, dtype=jnp.float32) @ params["wte"] + params["wpe"]
    b, s, e = x.shape
    for p in params["layers"]:
        qkv = sp.shard(jnp.matmul, par.columns)(M.layer_norm(x, p["ln1_g"], p["ln1_b"]), p["wqkv"])
        q, k, v = (t.reshape(b, s, cfg.heads, cfg.head_dim) for t in jnp.split(qkv, 3, axis=-1))
        causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
        scores = jnp.where(causal, jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(cfg.head_dim), -1e9)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, e)
        x = x + out @ p["wo"]
        h = sp.shard(jnp.matmul, par.columns)(M.layer_norm(x, p["ln2_g"], p["ln2_b"]), p["w1"])
        x = x + jax.nn.gelu(h) @ p["w2"]
    return M.layer_norm(x, params["lnf_g"], params["lnf_b"]) @ params["wte"].T


def fused_qkv_params(cfg):
    params = M.init_params(cfg)
    for layer in params["layers"]:
        layer["wqkv"] = np.concatenate([layer.pop(n).reshape(cfg.embed, cfg.embed) for n in ("wq", "wk", "wv")], 1)
    return params


def train_step_of(forward, par, cfg):
    opt = optax.adam(1e-3)

    def loss_fn(params, tokens, targets):
        logp = jax.nn.log_softmax(forward(params, tokens, par, cfg), axis=-1)
        return -jnp.mean(jnp.sum(jax.nn.one_hot(targets, cfg.vocab) * logp, axis=-1))

    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step, opt


@pytest.mark.slow
def test_post_ln_training_step_has_megatrons_all_reduce_count():
    """Backward, jax adds each of q, k, v's partial input gradients into a sum that already
    holds the residual's complete gradient; the partials are summed first and reduced once:
    4 all_reduces per layer as in Megatron (it was 6: one per projection)."""
    step, opt = train_step_of(post_ln_forward, M.Parallelism.tensor(8), CFG)
    state = opt.init(PARAMS)
    pstep = sp.parallelize(step, mesh=8, donate_argnums=(0, 1))
    plan = pstep.plan(PARAMS, state, TOKENS, TARGETS)
    assert [(c.kind, c.in_shape) for c in plan.collectives] == [("all_reduce", ACTIVATION)] * (4 * CFG.layers)
    assert_trees_close(pstep(PARAMS, state, TOKENS, TARGETS), jax.jit(step)(PARAMS, state, TOKENS, TARGETS))


def test_post_ln_training_step_2x4_keeps_megatrons_count_in_mp_groups():
    step, opt = train_step_of(post_ln_forward, M.Parallelism.data_and_tensor(), CFG)
    state = opt.init(PARAMS)
    plan = sp.parallelize(step, mesh=((2, 4), ("dp", "mp")), donate_argnums=(0, 1)).plan(PARAMS, state, TOKENS,
                                                                                        TARGETS)
    tp = [(c.kind, c.in_shape) for c in plan.collectives if c.groups == ((0, 1, 2, 3), (4, 5, 6, 7))]
    assert tp == [("all_reduce", (CFG.batch // 2, CFG.seq, CFG.embed))] * (4 * CFG.layers)


@pytest.mark.slow
def test_fused_qkv_column_split_gathers_once_per_layer():
    """GPT-2's fused [q|k|v] projection split on columns meets the q/k/v split: one
    all_gather of the projection per layer (not one per q, k and v), and the step equals
    one device's."""
    params = fused_qkv_params(CFG)
    step, opt = train_step_of(fused_qkv_forward, M.Parallelism.tensor(8), CFG)
    state = opt.init(params)
    pstep = sp.parallelize(step, mesh=8, donate_argnums=(0, 1))
    plan = pstep.plan(params, state, TOKENS, TARGETS)
    kinds = [c.kind for c in plan.collectives]
    assert kinds.count("all_gather") == CFG.layers and "all_to_all" not in kinds
    assert kinds.count("all_reduce") <= 4 * CFG.layers
    assert_trees_close(pstep(params, state, TOKENS, TARGETS), jax.jit(step)(params, state, TOKENS, TARGETS))


# -- the same two layers with mode="auto": the marks kept, every other op searched --------------
MESH_2x4 = ((2, 4), ("dp", "mp"))
MP_GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))


@pytest.mark.slow
def test_auto_post_ln_step_keeps_megatrons_all_reduce_count():
    """The search, like propagation, sums the q/k/v partial input gradients before
    reducing them: 4 mp all_reduces per layer (Megatron's count; the partials reduced one
    by one would be 6)."""
    step, opt = train_step_of(post_ln_forward, M.Parallelism.data_and_tensor(), CFG)
    state = opt.init(PARAMS)
    pstep = sp.parallelize(step, mesh=MESH_2x4, mode="auto", donate_argnums=(0, 1))
    plan = pstep.plan(PARAMS, state, TOKENS, TARGETS)
    tp = [c.kind for c in plan.collectives if c.groups == MP_GROUPS and c.kind in ("all_reduce", "reduce_scatter")]
    assert tp == ["all_reduce"] * (4 * CFG.layers)
    assert_trees_close(pstep(PARAMS, state, TOKENS, TARGETS), jax.jit(step)(PARAMS, state, TOKENS, TARGETS))


@pytest.mark.slow
def test_auto_fused_qkv_gathers_the_projection_once_per_layer():
    """GPT-2's fused [q|k|v] projection split on columns: the search gathers it once per
    layer over mp, never q, k and v one by one."""
    params = fused_qkv_params(CFG)
    step, opt = train_step_of(fused_qkv_forward, M.Parallelism.data_and_tensor(), CFG)
    state = opt.init(params)
    pstep = sp.parallelize(step, mesh=MESH_2x4, mode="auto", donate_argnums=(0, 1))
    plan = pstep.plan(params, state, TOKENS, TARGETS)
    mp_gathers = [c.in_shape[-1] for c in plan.collectives if c.kind == "all_gather" and c.groups == MP_GROUPS
                  and len(c.in_shape) == 3]
    assert mp_gathers.count(3 * CFG.embed // 4) == CFG.layers     # the fused projection, once per layer
    assert CFG.embed // 4 not in mp_gathers                         # q, k or v gathered on its own
    assert_trees_close(pstep(params, state, TOKENS, TARGETS), jax.jit(step)(params, state, TOKENS, TARGETS))
