"""Pipeline parallelism end to end (issue 26): sp.stage_boundary, sp.Pipeline, the stage
assignment and the SPMD lowering, each schedule against one device."""
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardprop as sp
from shardprop.compiler.pipeline_step import unpack
from shardprop.runtime.pipeline_lower import (SMALL_GAP, PackedLeaf, bubble_computes_nothing, noop_branch_opcodes,
                                             zero_filled_concatenates)

D, B = 8, 16


def mlp(layers, cuts, opt=None):
    """An MLP step with a stage_boundary after every layer index in ``cuts``."""
    opt = opt or optax.adam(1e-2)

    def loss_fn(params, batch):
        x, y = batch
        h = x
        for i, w in enumerate(params):
            h = jnp.tanh(h @ w["w"] + w["b"])
            if i in cuts:
                h = sp.stage_boundary(h)
        return jnp.mean((h - y) ** 2)

    def step(params, opt_state, batch):
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        up, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, up), opt_state, loss

    k = jax.random.PRNGKey(0)
    params = [{"w": jax.random.normal(jax.random.fold_in(k, i), (D, D)) * 0.5, "b": jnp.zeros(D)}
              for i in range(layers)]
    x = jax.random.normal(jax.random.fold_in(k, 100), (B, D))
    y = jax.random.normal(jax.random.fold_in(k, 101), (B, D))
    return step, params, opt.init(params), (x, y)


def even_cuts(layers, stages):
    bounds = np.linspace(0, layers, stages + 1).round().astype(int)
    return set(int(b) - 1 for b in bounds[1:-1])


def assert_matches_one_device(step, params, opt_state, data, pstep, steps=5):
    """``steps`` steps of ``pstep(params, opt_state, *data)`` against one device's: losses
    every step, then parameters and optimizer state (``data``: the step's other arguments)."""
    ref = jax.jit(step)
    p1, o1, p2, o2 = params, opt_state, params, opt_state
    for _ in range(steps):
        p1, o1, l1 = ref(p1, o1, *data)
        p2, o2, l2 = pstep(p2, o2, *data)
        np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(unpack((p2, o2))), jax.tree.leaves((p1, o1))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
    return p2, o2


def gpt_pipeline_case(layers: int, batch: int, marked_stages: int, tied: bool = False):
    """examples/gpt_pipeline.py's step at a tiny size: (step, params, Adam state, (tokens, targets))."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))   # it imports gpt_megatron
    import gpt_pipeline
    cfg = gpt_pipeline.Config(layers=layers, batch=batch, vocab=32, seq=8, heads=2, head_dim=4)
    params = gpt_pipeline.init_pipeline_params(cfg, tied=tied)
    step, opt = gpt_pipeline.make_train_step(cfg, marked_stages)
    return step, params, opt.init(params), tuple(gpt_pipeline.make_batch(cfg))


def test_stage_boundary_is_an_identity_under_jit_grad_vmap():
    f = lambda x: jnp.sum(jnp.sin(sp.stage_boundary({"a": x, "b": 2 * x})["a"]))
    x = jnp.arange(6.0).reshape(2, 3)
    assert float(jax.jit(f)(x)) == pytest.approx(float(jnp.sum(jnp.sin(x))))
    np.testing.assert_allclose(jax.grad(f)(x), jnp.cos(x), rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(jax.grad(f))(x), jnp.cos(x), rtol=1e-6)
    text = str(jax.make_jaxpr(jax.grad(f))(x))
    assert "stage_boundary[direction=forward]" in text and "stage_boundary[direction=backward]" in text
    # the non-pipelined compiler treats it as an identity
    out = sp.parallelize(lambda x: sp.stage_boundary(x) * 2, mesh=2)(x)
    np.testing.assert_allclose(np.asarray(out), 2 * np.asarray(x))


@pytest.mark.slow
def test_mlp_pp2_1f1b_equals_one_device():
    step, params, opt_state, batch = mlp(2, {0})
    pstep = sp.parallelize(step, mesh=((2,), ("pp",)), pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
    p2, o2 = assert_matches_one_device(step, params, opt_state, (batch,), pstep, steps=3)   # 5 in the slow tier
    leaf = p2[1]["w"]
    assert isinstance(leaf, PackedLeaf) and leaf.rank == 1 and sp.to_numpy(leaf).shape == (D, D)


@pytest.mark.slow
def test_mlp_pp4_1f1b_equals_one_device():
    step, params, opt_state, batch = mlp(4, {0, 1, 2})
    pstep = sp.parallelize(step, mesh=((4,), ("pp",)), pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
    p2, o2 = assert_matches_one_device(step, params, opt_state, (batch,), pstep)
    # the state stays packed on its rank between steps
    leaf = p2[2]["w"]
    assert isinstance(leaf, PackedLeaf) and leaf.rank == 2 and sp.to_numpy(leaf).shape == (D, D)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,p,v", [("gpipe", 8, 1), ("1f1b", 8, 1), ("interleaved", 4, 2),
                                          ("zero_bubble", 4, 1)])
def test_mlp_schedules_equal_one_device(schedule, p, v):
    step, params, opt_state, batch = mlp(8, even_cuts(8, p * v))
    pstep = sp.parallelize(step, mesh=((p,), ("pp",)),
                           pipeline=sp.Pipeline(microbatches=4 if v == 1 else p, schedule=schedule,
                                                virtual_stages=v))
    assert_matches_one_device(step, params, opt_state, (batch,), pstep)


@pytest.mark.slow
def test_thirty_layers_on_pp4_every_layer_once():
    cuts = {7, 15, 22}   # 8, 8, 7, 7 layers
    step, params, opt_state, batch = mlp(30, cuts)
    pstep = sp.parallelize(step, mesh=((4,), ("pp",)), pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
    plan = pstep.plan(params, opt_state, batch)
    per_stage = [st.forward_ops.count("tanh") for st in plan.pipeline.stages]
    assert per_stage == [8, 8, 7, 7]
    owned = [sorted(int(re.match(r"\[0\]\[(\d+)\]", path).group(1)) for path, _ in st.params
                    if path.startswith("[0]")) for st in plan.pipeline.stages]
    assert sorted(i for o in owned for i in set(o)) == list(range(30))
    # every equation of the traced step runs in exactly one program (floats aside)
    an = plan.program.an
    seen = [i for st in an.stages for i in st.forward + st.backward + st.once]
    assert len(seen) == len(set(seen))
    assert_matches_one_device(step, params, opt_state, (batch,), pstep, steps=3)


def forward_only_case():
    """A four-stage forward (no gradient, no optimizer): infer, its weights, its input."""
    k = jax.random.PRNGKey(1)
    ws = [jax.random.normal(jax.random.fold_in(k, i), (D, D)) for i in range(4)]

    def infer(ws, x):
        h = x
        for i, w in enumerate(ws):
            h = jnp.tanh(h @ w)
            if i < 3:
                h = sp.stage_boundary(h)
        return h, jnp.sum(h)

    return infer, ws, jax.random.normal(k, (B, D))


def test_forward_only_pipeline():
    infer, ws, x = forward_only_case()
    pinf = sp.parallelize(infer, mesh=((4,), ("pp",)), pipeline=sp.Pipeline(microbatches=4, schedule="gpipe"))
    out, total = pinf(ws, x)
    ref, rtotal = jax.jit(infer)(ws, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(total), np.asarray(rtotal), rtol=1e-5)
    plan = pinf.plan(ws, x)
    assert all(a.kind == "forward" for a in plan.pipeline.schedule.values())
    assert plan.pipeline.ticks == 4 + 4 - 1


def test_plan_pipeline_stages_schedule_bubble():
    step, params, opt_state, batch = mlp(4, {0, 1, 2})
    pstep = sp.parallelize(step, mesh=((4,), ("pp",)), pipeline=sp.Pipeline(microbatches=4, schedule="gpipe"))
    pl = pstep.plan(params, opt_state, batch).pipeline
    assert [s.rank for s in pl.stages] == [0, 1, 2, 3]
    assert [s.devices for s in pl.stages] == [(0,), (1,), (2,), (3,)]
    assert pl.unit_bubble == pytest.approx(3 / 7)
    # the modeled bubble: the simulator on the cost model's stage times and exchange latencies
    assert pl.bubble == pytest.approx(float(pl.model_sim.bubble)) and 0 < pl.bubble < 1
    assert pl.step_time > 0 and all(t["forward"] > 0 and t["backward"] > 0 for t in pl.stage_times)
    assert pl.schedule[(0, 0)].kind == "forward" and pl.schedule[(0, 0)].microbatch == 0
    assert (0, 1) not in pl.schedule       # stage 1 idles on tick 0
    assert "stage 3" in pl.text() and "F0" in pl.text()


@pytest.mark.slow
def test_compiled_program_per_rank_checks():
    """Exchanges only between neighbours, no parameter gathered over pp, per-device state
    bytes about one stage's, bubble ticks compute nothing."""
    step, params, opt_state, batch = mlp(4, {0, 1, 2})
    pstep = sp.parallelize(step, mesh=((4,), ("pp",)), pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
    compiled = pstep.compiled(params, opt_state, batch)
    hlo = compiled.as_text()
    pairs = re.findall(r"source_target_pairs=\{([{}0-9,]*)\}", hlo)
    assert pairs, "no collective-permute"
    for group in pairs:
        for a, b in re.findall(r"\{(\d+),(\d+)\}", group):
            assert abs(int(a) - int(b)) == 1
    assert "all-gather" not in hlo
    stage_state = sum(l.size for l in jax.tree.leaves(params[0])) * 3 * 4   # params + Adam mu, nu
    plan = pstep.plan(params, opt_state, batch)
    assert plan.program.state_size * 4 <= 1.1 * stage_state
    # the no-op branch of the tick's switch: only moves its buffers
    ops = noop_branch_opcodes(hlo)
    assert ops and bubble_computes_nothing(hlo), ops


def test_microbatches_must_divide_the_batch():
    step, params, opt_state, batch = mlp(4, {0, 1, 2})
    pstep = sp.parallelize(step, mesh=((4,), ("pp",)), pipeline=sp.Pipeline(microbatches=5))
    with pytest.raises(sp.ShardingError, match=r"microbatches=5.*16"):
        pstep(params, opt_state, batch)


def test_batch_norm_statistics_with_microbatches_is_an_error():
    def loss_fn(w, x):
        h = x @ w[0]
        h = (h - jnp.mean(h, axis=0)) / jnp.sqrt(jnp.var(h, axis=0) + 1e-5)   # batch norm
        h = sp.stage_boundary(h)
        return jnp.mean(h @ w[1])

    def step(w, x):
        l, g = jax.value_and_grad(loss_fn)(w, x)
        return [a - 0.1 * b for a, b in zip(w, g)], l

    w = [jnp.ones((D, D)), jnp.ones((D, D))]
    pstep = sp.parallelize(step, mesh=((2,), ("pp",)), pipeline=sp.Pipeline(microbatches=2))
    with pytest.raises(sp.ShardingError, match=r"sub at test_pipeline_lowering.py:\d+: a batch-mixing op.*microbatches=2"):
        pstep(w, jnp.ones((B, D)))


def test_stage_boundary_inside_a_loop_is_an_error():
    def loss_fn(w, x):
        h, _ = jax.lax.scan(lambda h, wi: (sp.stage_boundary(jnp.tanh(h @ wi)), None), x, w)
        return jnp.mean(h)

    def step(w, x):
        l, g = jax.value_and_grad(loss_fn)(w, x)
        return w - 0.1 * g, l

    pstep = sp.parallelize(step, mesh=((2,), ("pp",)), pipeline=sp.Pipeline(microbatches=2))
    with pytest.raises(sp.ShardingError, match=r"scan.*stage_boundary inside a loop"):
        pstep(jnp.ones((3, D, D)), jnp.ones((B, D)))


def test_options_a_pipeline_does_not_take_yet_are_refused_by_name():
    step, params, opt_state, batch = mlp(2, {0})
    with pytest.raises(sp.ShardingError, match=r"does not take mode, donate_argnums yet(.|\n)*fix: +drop mode"):
        sp.parallelize(step, mesh=((2,), ("pp",)), mode="data_parallel", donate_argnums=(0, 1),
                       pipeline=sp.Pipeline(microbatches=2))
    with pytest.raises(sp.ShardingError, match="does not take shard_params yet"):
        sp.parallelize(step, mesh=((2,), ("pp",)), shard_params=True, pipeline=sp.Pipeline(microbatches=2))


def test_mesh_errors():
    with pytest.raises(sp.ShardingError, match="the mesh has axes"):
        sp.parallelize(lambda x: x, mesh=((4, 2), ("stage", "mp")), pipeline=sp.Pipeline(microbatches=8))
    with pytest.raises(sp.ShardingError, match="needs 3 sp.stage_boundary marks"):
        step, params, opt_state, batch = mlp(4, {1})
        sp.parallelize(step, mesh=((4,), ("pp",)), pipeline=sp.Pipeline(microbatches=2))(params, opt_state, batch)
    with pytest.raises(sp.ShardingError, match="multiple of"):
        sp.Pipeline(microbatches=3, schedule="interleaved", virtual_stages=2) and \
            sp.parallelize(*mlp(4, {0, 1, 2})[:1], mesh=((2,), ("pp",)),
                           pipeline=sp.Pipeline(microbatches=3, schedule="interleaved", virtual_stages=2))(
                *mlp(4, {0, 1, 2})[1:])


def test_dump_dir_writes_each_ranks_program(tmp_path):
    step, params, opt_state, batch = mlp(2, {0})
    pstep = sp.parallelize(step, mesh=((2,), ("pp",)), pipeline=sp.Pipeline(microbatches=2, schedule="1f1b"),
                           dump_dir=str(tmp_path))
    pstep.plan(params, opt_state, batch)
    assert "modeled bubble" in (tmp_path / "pipeline.txt").read_text()
    rank1 = (tmp_path / "pipeline_rank1.txt").read_text()
    assert "stage 1 forward" in rank1 and "sends its input cotangents to rank 0" in rank1 and "ticks:" in rank1
    page = (tmp_path / "pipeline.html").read_text()
    assert page.count("<tr><th>rank") == 2 and 'class="bubble"' in page and ">F0<" in page and ">B1<" in page


@pytest.mark.slow
def test_gpt_pipeline_example_pp4_equals_one_device():
    step, params, state, data = gpt_pipeline_case(4, 8, 4)
    pstep = sp.parallelize(step, mesh=((4,), ("pp",)), batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
    assert_matches_one_device(step, params, state, data, pstep)


def tied_and_clipped():
    """Three stages: a weight used by the first and the last, and Adam after a global
    gradient-norm clip (once ops that combine stages). Returns step, w, opt state, x."""
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))

    def loss_fn(w, x):
        h = sp.stage_boundary(jnp.tanh(x @ w["e"]))
        h = sp.stage_boundary(jnp.tanh(h @ w["m"]))
        return jnp.mean(jnp.tanh(h @ w["e"].T) ** 2)

    def step(w, o, x):
        loss, g = jax.value_and_grad(loss_fn)(w, x)
        up, o = opt.update(g, o, w)
        return optax.apply_updates(w, up), o, loss

    k = jax.random.PRNGKey(0)
    w = {"e": jax.random.normal(k, (D, D)), "m": jax.random.normal(jax.random.fold_in(k, 1), (D, D))}
    x = jax.random.normal(jax.random.fold_in(k, 2), (B, D))
    return step, w, opt.init(w), x


@pytest.mark.slow
def test_tied_weights_and_global_norm_clipping_equal_one_device():
    """A weight used by the first and the last stage and a global gradient norm: once ops
    that combine stages run on every rank after a broadcast over pp."""
    step, w, o, x = tied_and_clipped()
    pstep = sp.parallelize(step, mesh=((3,), ("pp",)), pipeline=sp.Pipeline(microbatches=4))
    assert_matches_one_device(step, w, o, (x,), pstep, steps=3)
    assert pstep.plan(w, o, x).program.nphases == 2


@pytest.mark.slow
def test_tied_embedding_gpt_pp4_equals_one_device():
    """The tied embedding and its Adam state are stored on the two owner stages only
    (ranks 0 and 3); its new value comes back on both, and the next step reads it in place."""
    step, params, state, data = gpt_pipeline_case(4, 8, 4, tied=True)
    pstep = sp.parallelize(step, mesh=((4,), ("pp",)), batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
    p2, s2 = assert_matches_one_device(step, params, state, data, pstep)
    assert isinstance(p2["wte"], PackedLeaf) and (p2["wte"].rank, dict(p2["wte"].others).keys()) == (0, {3})
    prog = pstep.plan(params, state, *data).program
    wte = prog.j.invars[[jax.tree_util.keystr(k) for k, _ in
                         jax.tree_util.tree_flatten_with_path((params, state))[0]].index("[0]['wte']")]
    assert [wte in pk.offset for pk in prog.state_pack] == [True, False, False, True]


@pytest.mark.slow
def test_pp4_by_dp2_equals_one_device():
    """Data parallel inside each stage: every micro-batch split over dp, the accumulated
    partial sums all-reduced over dp before the optimizer update."""
    step, params, opt_state, batch = mlp(4, {0, 1, 2})
    pstep = sp.parallelize(step, mesh=((4, 2), ("pp", "dp")), pipeline=sp.Pipeline(microbatches=4))
    assert_matches_one_device(step, params, opt_state, (batch,), pstep)
    hlo = pstep.lower_text(params, opt_state, batch)
    for group in re.findall(r"source_target_pairs=\{([{}0-9,]*)\}", hlo):
        for a, b in re.findall(r"\{(\d+),(\d+)\}", group):
            assert abs(int(a) - int(b)) == 2      # pp neighbours on a (pp, dp) mesh: device ids 2 apart


def test_forward_only_pp2_by_dp2():
    ws = [jnp.full((D, D), 0.1 * (i + 1)) for i in range(2)]

    def infer(ws, x):
        return jnp.tanh(sp.stage_boundary(jnp.tanh(x @ ws[0])) @ ws[1])

    x = jax.random.normal(jax.random.PRNGKey(0), (B, D))
    pinf = sp.parallelize(infer, mesh=((2, 2), ("dp", "pp")), pipeline=sp.Pipeline(microbatches=2))
    np.testing.assert_allclose(np.asarray(pinf(ws, x)), np.asarray(infer(ws, x)), rtol=1e-5, atol=1e-6)
    with pytest.raises(sp.ShardingError, match="does not split over 2 data-parallel devices"):
        pinf(ws, x[:6])


@pytest.mark.slow
def test_1f1b_keeps_fewer_activations_than_gpipe():
    """1F1B's stash holds about p micro-batches per rank where GPipe's holds m: fewer
    activation slots and a smaller compiled temp footprint."""
    step, params, opt_state, _ = mlp(4, {0, 1, 2})
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((64, D)).astype(np.float32), rng.standard_normal((64, D)).astype(np.float32))
    got = {}
    for name in ("gpipe", "1f1b"):
        pstep = sp.parallelize(step, mesh=((4,), ("pp",)), pipeline=sp.Pipeline(microbatches=16, schedule=name))
        slots = pstep.plan(params, opt_state, batch).pipeline.slots
        temp = pstep.compiled(params, opt_state, batch).memory_analysis().temp_size_in_bytes
        got[name] = (slots, temp)
    assert got["gpipe"][0] == 16 and got["1f1b"][0] == 4
    assert got["1f1b"][1] < got["gpipe"][1]


@pytest.mark.slow
def test_automatic_cuts_without_marks_equal_one_device():
    """No stage_boundary: the forward is cut by modeled time where little crosses, and the
    backward follows the forward values it reads."""
    step, params, opt_state, batch = mlp(4, set())
    pstep = sp.parallelize(step, mesh=((2,), ("pp",)), pipeline=sp.Pipeline(microbatches=2))
    plan = pstep.plan(params, opt_state, batch)
    assert [s.forward_ops.count("tanh") for s in plan.pipeline.stages] == [2, 2]
    assert plan.program.an.cuts is not None
    assert_matches_one_device(step, params, opt_state, (batch,), pstep, steps=3)


def test_automatic_cuts_balance_unequal_layers():
    """Layers of very different widths: the automatic cuts' modeled step is at least 1.3x
    faster than cutting after equal layer counts (both priced by the same simulator; only
    traced, from shapes)."""
    def make(cuts):
        def loss_fn(ws, x):
            h = x
            for i, w in enumerate(ws):
                h = jnp.tanh(h @ w)
                if i in cuts:
                    h = sp.stage_boundary(h)
            return jnp.mean(h ** 2)

        def step(ws, x):
            loss, g = jax.value_and_grad(loss_fn)(ws, x)
            return [w - 0.01 * gw for w, gw in zip(ws, g)], loss
        return step

    big, small, f32 = 8192, 512, jnp.float32
    ws = [jax.ShapeDtypeStruct((big, big), f32)] * 4 + [jax.ShapeDtypeStruct((big, small), f32)] + \
        [jax.ShapeDtypeStruct((small, small), f32)] * 3
    x = jax.ShapeDtypeStruct((4096, big), f32)
    times = {}
    for name, cuts in (("even", {1, 3, 5}), ("auto", set())):
        pstep = sp.parallelize(make(cuts), mesh=((4,), ("pp",)), pipeline=sp.Pipeline(microbatches=8))
        times[name] = pstep.plan(ws, x).pipeline.step_time
    assert times["even"] >= 1.3 * times["auto"], times


@pytest.mark.slow
def test_automatic_cuts_tied_gpt_pp4_equals_one_device():
    step, params, state, data = gpt_pipeline_case(4, 8, 1, tied=True)   # one stage: no marks at all
    pstep = sp.parallelize(step, mesh=((4,), ("pp",)), batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
    plan = pstep.plan(params, state, *data)
    assert [s.forward_ops.count("tanh") for s in plan.pipeline.stages] == [1, 1, 1, 1]   # one gelu: a block each
    assert_matches_one_device(step, params, state, data, pstep)


def test_auto_microbatches_and_schedule_pick_the_least_modeled_step():
    step, params, opt_state, batch = mlp(4, {0, 1, 2})
    pstep = sp.parallelize(step, mesh=((4,), ("pp",)),
                           pipeline=sp.Pipeline(microbatches="auto", schedule="auto"))
    pl = pstep.plan(params, opt_state, batch).pipeline
    best, m, name, _ = pl.search[0]
    assert (m, name) == (pl.microbatches, pl.schedule_name)
    assert best == min(r[0] for r in pl.search)
    assert {r[2] for r in pl.search} == {"gpipe", "1f1b", "zero_bubble"}
    assert {r[1] for r in pl.search} == {1, 2, 4, 8}       # micro-batches of 2 rows or more
    # under a memory limit only the candidates that fit: GPipe's m slots cost more than 1F1B's p
    gpipe8 = next(r for r in pl.search if r[1:3] == (8, "gpipe"))
    limited = sp.parallelize(step, mesh=((4,), ("pp",)), memory_limit=gpipe8[3] - 1,
                             pipeline=sp.Pipeline(microbatches="auto", schedule="auto"))
    pl2 = limited.plan(params, opt_state, batch).pipeline
    assert (pl2.microbatches, pl2.schedule_name) != (8, "gpipe")
    assert next(r for r in pl2.search if r[1:3] == (pl2.microbatches, pl2.schedule_name))[3] < gpipe8[3]
    with pytest.raises(sp.ShardingError, match="no pipeline fits memory_limit=100 bytes"):
        sp.parallelize(step, mesh=((4,), ("pp",)), memory_limit=100,
                       pipeline=sp.Pipeline(microbatches="auto")).plan(params, opt_state, batch)


@pytest.mark.slow
def test_auto_microbatches_and_schedule_equal_one_device():
    step, params, opt_state, batch = mlp(4, {0, 1, 2})
    pstep = sp.parallelize(step, mesh=((4,), ("pp",)),
                           pipeline=sp.Pipeline(microbatches="auto", schedule="auto"))
    assert_matches_one_device(step, params, opt_state, (batch,), pstep, steps=3)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt_pp8_equals_one_device(schedule):
    step, params, state, data = gpt_pipeline_case(8, 16, 8)
    pstep = sp.parallelize(step, mesh=((8,), ("pp",)), batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=8, schedule=schedule))
    assert_matches_one_device(step, params, state, data, pstep)


@pytest.mark.slow
def test_one_heavy_stage_packs_without_zero_filled_concatenates():
    """Stages of unequal sizes (the last holds two layers 8x wider): each rank's pieces are
    padded to the largest stage's, by ``lax.pad``, not by a concatenate with zeros (which
    XLA CPU ran 10x slower than the whole step, docs/results/pipeline.md); the pipelined
    step equals one device's."""
    opt, d = optax.adam(1e-2), 16
    widths = [d, d, d, d, 8 * d, 8 * d]

    def loss_fn(params, x, y):
        h = x
        for i, (a, b) in enumerate(params):
            h = h + jnp.tanh(h @ a) @ b
            if i in (0, 2, 3):
                h = sp.stage_boundary(h)
        return jnp.mean((h - y) ** 2)

    def step(params, opt_state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        up, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, up), opt_state, loss

    k = jax.random.PRNGKey(1)
    params = [(jax.random.normal(jax.random.fold_in(k, 2 * i), (d, w)) / np.sqrt(d),
               jax.random.normal(jax.random.fold_in(k, 2 * i + 1), (w, d)) / np.sqrt(w)) for i, w in enumerate(widths)]
    x = jax.random.normal(jax.random.fold_in(k, 100), (B, d))
    y = jax.random.normal(jax.random.fold_in(k, 101), (B, d))
    pstep = sp.parallelize(step, mesh=((4,), ("pp",)), batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
    prog = pstep.plan(params, opt.init(params), x, y).program
    sizes = [pk.size for _, pk in prog.acc_pack.values()]
    assert max(sizes) - min(sizes) > SMALL_GAP, sizes      # the pieces are padded: the case this guards
    assert zero_filled_concatenates(pstep.lower_text(params, opt.init(params), x, y)) == []
    assert_matches_one_device(step, params, opt.init(params), (x, y), pstep, steps=2)


@pytest.mark.parametrize("pairs", [((0, 2), (1, 3), (2, 0), (3, 1)), ((0, 1), (1, 2), (2, 0), (3, 3))])
def test_a_permute_by_gather_in_one_stages_branch_moves_the_blocks(pairs):
    """The SPMD lowering's permute over a stage's devices (``pipeline_submesh._permute_by_gather``),
    run in one pp rank's branch of a switch while the other rank's branch does something
    else: each device of the stage holds its source's block, and nothing waits for the
    other stage's devices."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardprop.compiler.pipeline_submesh import _permute_by_gather
    mesh = jax.make_mesh((2, 2, 2), ("pp", "a", "b"), devices=jax.devices()[:8])
    x = np.arange(2 * 8 * 3, dtype=np.float32).reshape(2, 8, 3)     # pp x (a, b) blocks of (2, 3)

    def body(x):
        moved = lambda x: _permute_by_gather(x, ("a", "b"), pairs)   # noqa: E731
        return jax.lax.switch(jax.lax.axis_index("pp"), [moved, lambda x: 2 * x], x)
    spec = P("pp", ("a", "b"))
    out = np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))(
        jax.device_put(x, NamedSharding(mesh, spec))))
    blocks = x[0].reshape(4, 2, 3)
    want = np.empty_like(blocks)
    for s, d in pairs:
        want[d] = blocks[s]
    np.testing.assert_array_equal(out[0], want.reshape(8, 3))
    np.testing.assert_array_equal(out[1], 2 * x[1])
