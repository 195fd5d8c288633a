"""Pipeline stages composed with tensor parallelism and ZeRO-1 (issue 26): the step planned
once on the mesh axes beside ``pp`` (compiler/pipeline_submesh.py), each stage's work run
tensor parallel, against one device; and the per-rank checks of the compiled program."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shardprop as sp
from shardprop.runtime.pipeline_lower import collectives_across_pipeline
from tests.test_pipeline_lowering import assert_matches_one_device

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt_pipeline  # noqa: E402


def gpt_case(layers: int, batch: int, stages: int, dp: bool = False, tied: bool = False):
    """examples/gpt_pipeline.py's step with gpt_megatron's two marks per layer (tiny sizes)."""
    cfg = gpt_pipeline.Config(layers=layers, batch=batch, vocab=32, seq=8, heads=2, head_dim=4)
    params = gpt_pipeline.init_pipeline_params(cfg, tied=tied)
    step, opt = gpt_pipeline.make_train_step(cfg, stages, tp=gpt_pipeline.tensor_parallel(dp=dp))
    return step, params, opt.init(params), tuple(gpt_pipeline.make_batch(cfg))


def tp_mlp(layers: int = 2, width: int = 8, batch: int = 8):
    """An MLP of column- then row-parallel pairs (Megatron's MLP), one stage per pair."""
    opt = optax.adam(1e-2)

    def loss_fn(params, x, y):
        h = x
        for i, (w1, w2) in enumerate(params):
            h = jnp.tanh(sp.shard(jnp.matmul, (P(None, None), P(None, "mp")))(h, w1)) @ w2
            if i < len(params) - 1:
                h = sp.stage_boundary(h)
        return jnp.mean((h - y) ** 2)

    def step(params, opt_state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        up, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, up), opt_state, loss

    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((width, 2 * width)).astype(np.float32) * 0.3,
               rng.standard_normal((2 * width, width)).astype(np.float32) * 0.3) for _ in range(layers)]
    x = rng.standard_normal((batch, width)).astype(np.float32)
    y = rng.standard_normal((batch, width)).astype(np.float32)
    return step, params, opt.init(params), (x, y)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sharding_propagation", "semi_auto"])
def test_tensor_parallel_mlp_pp2_mp2_equals_one_device(mode):
    """With semi_auto, the unmarked ops take the data-parallel default on the sub-mesh (the
    batch rows sliced over mp: a layout move inside each micro-batch, not a batch mix)."""
    step, params, opt_state, data = tp_mlp()
    pstep = sp.parallelize(step, mesh=((2, 2), ("pp", "mp")), batch_argnums=(2, 3), mode=mode,
                           pipeline=sp.Pipeline(microbatches=2, schedule="1f1b"))
    assert_matches_one_device(step, params, opt_state, data, pstep)
    # each rank holds its stage's first weight's column half
    plan = pstep.plan(params, opt_state, *data)
    assert [plan.program.j.invars[i].aval.shape for i in (0, 2)] == [(8, 8)] * 2


@pytest.mark.slow
@pytest.mark.parametrize("schedule,v,layers", [("1f1b", 1, 4), ("interleaved", 2, 8), ("zero_bubble", 1, 4)])
def test_gpt_pp4_mp2_equals_one_device(schedule, v, layers):
    step, params, opt_state, data = gpt_case(layers, 8, 4 * v)
    pstep = sp.parallelize(step, mesh=((4, 2), ("pp", "mp")), batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=4, schedule=schedule, virtual_stages=v))
    assert_matches_one_device(step, params, opt_state, data, pstep)


@pytest.mark.slow
def test_gpt_pp2_dp2_mp2_zero1_equals_one_device():
    step, params, opt_state, data = gpt_case(2, 8, 2, dp=True)
    pstep = sp.parallelize(step, mesh=((2, 2, 2), ("pp", "dp", "mp")), batch_argnums=(2, 3),
                           shard_optimizer_state=True, pipeline=sp.Pipeline(microbatches=2, schedule="1f1b"))
    assert_matches_one_device(step, params, opt_state, data, pstep)
    # ZeRO-1: every optimizer-state leaf that splits is split over dp, on top of its
    # parameter's mp split (Adam's mu and nu of an mp-split weight: over dp x mp)
    prog = pstep.plan(params, opt_state, *data).program
    paths = [jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path((params, opt_state))[0]]
    n_params = len(jax.tree.leaves(params))
    for i, leaf in enumerate(jax.tree.leaves(opt_state)):
        axes = sum(prog.sub.in_dims[n_params + i], ())
        if np.ndim(leaf):
            assert "dp" in axes, (paths[n_params + i], axes)
        if paths[n_params + i].endswith("['w1']"):
            assert set(axes) == {"dp", "mp"}, (paths[n_params + i], axes)
    # every exchange over dp (the gradients' reduce-scatter, the parameters' gather, the
    # loss) runs once per step, after the last micro-batch; none per micro-batch
    over_dp = [(e.primitive.name, prog.an.roles[k]) for k, e in enumerate(prog.j.eqns)
               if e.primitive.name in ("psum", "reduce_scatter", "all_gather", "all_to_all", "ppermute")
               and "dp" in np.atleast_1d(e.params.get("axes", e.params.get("axis_name")))]
    assert {n for n, _ in over_dp} >= {"reduce_scatter", "all_gather"}
    assert all(role == "once" for _, role in over_dp), over_dp


def held_and_stage_params(prog, n_params: int, d: int) -> tuple:
    """Elements of parameters rank ``d`` holds (local blocks, every device of its sub-mesh
    alike) and the global elements of the parameters its stages own."""
    mine = [i for i in range(n_params) if d in prog.ranks_of(i)]
    return (sum(int(np.prod(prog.j.invars[i].aval.shape)) for i in mine),
            sum(int(np.prod(prog.sub.in_shapes[i])) for i in mine))


@pytest.mark.slow
def test_tied_embedding_gpt_pp4_mp2_equals_one_device():
    """The tied embedding (and its Adam state) on its two owner stages only, its two
    gradients summed between them; bytes per device at most 1.1 x the stage's / tp."""
    step, params, opt_state, data = gpt_case(4, 8, 4, tied=True)
    pstep = sp.parallelize(step, mesh=((4, 2), ("pp", "mp")), batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
    p2, _ = assert_matches_one_device(step, params, opt_state, data, pstep)
    assert p2["wte"].rank == 0 and dict(p2["wte"].others).keys() == {3}
    prog = pstep.plan(params, opt_state, *data).program
    paths = [jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path((params, opt_state))[0]]
    for i, path in enumerate(paths):
        if "wte" in path:
            assert prog.owner[i] == (0, 3), (path, prog.owner[i])
    n_params = len(jax.tree.leaves(params))
    assert all(o != -1 for o in prog.owner[:n_params])
    for d in range(4):
        held, stage = held_and_stage_params(prog, n_params, d)
        assert held <= 1.1 * stage / 2, (d, held, stage)


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 2])
def test_fewer_microbatches_than_stages_equals_one_device(m):
    """m < p: the schedule idles more, the result is the same."""
    step, params, opt_state, data = tp_mlp(layers=4)
    pstep = sp.parallelize(step, mesh=((4, 2), ("pp", "mp")), batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=m, schedule="1f1b"))
    assert_matches_one_device(step, params, opt_state, data, pstep)
    assert pstep.plan(params, opt_state, *data).pipeline.microbatches == m


@pytest.mark.slow
def test_per_rank_checks_pp4_mp2():
    """On the tied-embedding GPT: exchanges over pp only between neighbours (same mp rank),
    but for the tied embedding's gradients, which go between its owners (ranks 0 and 3)
    only, by collective-permutes of its local block; no parameter gathered or reduced over
    pp (only scalars cross it); parameter bytes per device at most 1.1 x the stage's
    parameters / tp."""
    step, params, opt_state, data = gpt_case(4, 8, 4, tied=True)
    pp, mp = 4, 2
    pstep = sp.parallelize(step, mesh=((pp, mp), ("pp", "mp")), batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
    hlo = pstep.lower_text(params, opt_state, *data)
    crossing = collectives_across_pipeline(hlo, mp)
    wte_block = int(np.prod(params["wte"].shape)) // mp
    permutes = [(elems, pairs) for kind, elems, pairs in crossing if kind == "collective-permute"]
    assert permutes
    tied = [(elems, pairs) for elems, pairs in permutes if any(abs(a[0] - b[0]) > 1 for a, b in pairs)]
    assert tied, "no exchange between the tied embedding's owners"
    for elems, pairs in permutes:
        assert all(a[1] == b[1] for a, b in pairs), pairs          # within one mp rank
        if (elems, pairs) in tied:                                  # the tied gradients: owners only
            assert elems == wte_block and all({a[0], b[0]} == {0, pp - 1} for a, b in pairs), (elems, pairs)
        else:
            assert all(abs(a[0] - b[0]) == 1 for a, b in pairs), pairs
    smallest = min(np.size(x) for x in jax.tree.leaves(params))
    for kind, elems, groups in crossing:
        if kind != "collective-permute":
            assert kind == "all-reduce" and elems < smallest, (kind, elems, groups)
    prog = pstep.plan(params, opt_state, *data).program
    n_params = len(jax.tree.leaves(params))
    assert all(o != -1 for o in prog.owner[:n_params])   # no parameter replicated over pp
    for d in range(pp):
        held, stage = held_and_stage_params(prog, n_params, d)
        assert held <= 1.1 * stage / mp, (d, held, stage)


def test_options_with_a_pipeline():
    step, params, opt_state, data = tp_mlp()
    with pytest.raises(sp.ShardingError, match="does not take mode yet"):
        sp.parallelize(step, mesh=((2, 2), ("pp", "mp")), mode="data_parallel", pipeline=sp.Pipeline(microbatches=2))
    assert sp.parallelize(step, mesh=((2, 2), ("pp", "mp")), mode="auto", pipeline=sp.Pipeline(microbatches=2)).planned
    with pytest.raises(sp.ShardingError, match="ZeRO-1 splits the optimizer state over data-parallel axes"):
        sp.parallelize(step, mesh=((2, 2), ("pp", "mp")), shard_optimizer_state=True,
                       pipeline=sp.Pipeline(microbatches=2))
    pstep = sp.parallelize(step, mesh=((2, 2), ("pp", "mp")), mode="semi_auto", batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=2))
    assert pstep.planned and pstep.mode == "semi_auto"
