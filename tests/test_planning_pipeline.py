"""Planning pipeline stages without the devices (issues 26 and 28): sp.plan_step on a mesh
with a pp axis prices each stage's state and in-flight activations, the step from the
schedule simulator with pp's exchanges on the cluster's links; mode="auto" chooses the
mesh shape; shardprop plan takes a pp axis."""
import json
import math
import sys
from pathlib import Path

import pytest

import shardprop as sp
from shardprop.ir.mesh import Mesh
from shardprop.passes.cost import resolve_cost_model
from shardprop.passes.pipeline.search import search_pipeline

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import gpt_plan  # noqa: E402

CFG = gpt_plan.GPT(layers=4, hidden=128, heads=4, seq=32, vocab=256, batch=16, remat=False,
                   compute_dtype="float32")
CLUSTER = sp.Cluster(1, 8, "a100-80gb")


@pytest.fixture(scope="module")
def step():
    return gpt_plan.train_step_and_args(CFG)


def plan(step, mesh, **kw):
    fn, args = step
    return sp.plan_step(fn, args, mesh=mesh, cost_model=CLUSTER, tokens=CFG.batch * CFG.seq, **kw)


def hand_parameter_bytes(cfg, tp):
    """Megatron's layout: attention and MLP weights split tp ways (12 h^2 per layer), the
    embedding (tied head) split by vocabulary, norms and positions whole; fp32."""
    h = cfg.hidden
    return 4 * (cfg.layers * (12 * h * h / tp + 4 * h) + cfg.vocab * h / tp + cfg.seq * h + 2 * h)


def test_memory_per_device_matches_the_hand_formula(step):
    est = plan(step, ((2, 2, 2), ("pp", "dp", "mp")), pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
    pipe = est.extra["pipeline"]
    assert (pipe["pp"], pipe["dp"], pipe["tp"], pipe["microbatches"], pipe["schedule"]) == (2, 2, 2, 4, "1f1b")
    ranks = pipe["ranks"]
    assert len(ranks) == 2 and all(r["parameters"] > 0 for r in ranks)
    total = sum(r["parameters"] for r in ranks)
    assert total == pytest.approx(hand_parameter_bytes(CFG, 2), rel=0.02)
    # Adam's two moments of every parameter (and its step count), laid out as the plan chose
    assert sum(r["optimizer_state"] for r in ranks) == pytest.approx(2 * hand_parameter_bytes(CFG, 2), rel=0.02)
    for r in ranks:                  # a gradient per parameter, laid out like it
        assert r["gradients"] == r["parameters"]
        assert r["peak"] == pytest.approx(r["parameters"] + r["gradients"] + r["optimizer_state"]
                                          + r["activations"] + est.other_input_bytes)
    fullest = max(ranks, key=lambda r: r["peak"])
    assert est.param_bytes == fullest["parameters"] and est.peak_bytes == fullest["peak"]
    # 1F1B: stage 0 keeps p = 2 micro-batches in flight, the last stage one
    assert pipe["search"].best.cuts.in_flight == (2, 1)


@pytest.mark.slow
def test_a_pp_axis_halves_the_parameters_per_device(step):
    one = plan(step, ((1, 2, 4), ("pp", "dp", "mp")), pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
    two = plan(step, ((2, 1, 4), ("pp", "dp", "mp")), pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
    ranks = two.extra["pipeline"]["ranks"]
    assert sum(r["parameters"] for r in ranks) == pytest.approx(one.param_bytes, rel=1e-6)
    assert 0.4 * one.param_bytes <= two.param_bytes <= 0.6 * one.param_bytes
    assert two.link_bytes and two.extra["pipeline"]["bubble"] > 0


@pytest.mark.slow
def test_one_stage_agrees_with_the_plain_plan(step):
    """pp=1 through the pipeline path (layers priced one by one, gradients all-reduced after
    the last micro-batch) against plan_step on the same dp x mp mesh."""
    plain = plan(step, ((2, 4), ("dp", "mp")))
    piped = plan(step, ((1, 2, 4), ("pp", "dp", "mp")), pipeline=sp.Pipeline(microbatches=1, schedule="1f1b"))
    assert piped.param_bytes == pytest.approx(plain.param_bytes, rel=1e-6)
    assert piped.optimizer_bytes == pytest.approx(plain.optimizer_bytes, rel=1e-6)
    assert piped.step_s == pytest.approx(plain.step_s, rel=0.15)
    assert piped.flops == pytest.approx(plain.flops, rel=0.02)


@pytest.mark.slow
def test_auto_chooses_a_mesh_shape_no_slower_than_any_listed_one():
    cfg = gpt_plan.GPT(layers=2, hidden=64, heads=4, seq=16, vocab=128, batch=16, remat=False,
                       compute_dtype="float32")
    fn, args = gpt_plan.train_step_and_args(cfg)
    est = sp.plan_step(fn, args, mesh=((2, 2, 2), ("pp", "dp", "mp")), cost_model=CLUSTER, mode="auto")
    pipe = est.extra["pipeline"]
    assert pipe["pp"] * pipe["dp"] * pipe["tp"] == 8
    assert set(pipe["stage_costs"]) == {1, 2, 4}       # 4 heads do not split 8 ways: tp=8 is rejected
    assert any(c.tp == 8 and "cannot be planned on tp=8" in c.reason for c in pipe["search"].rejected)
    cost = resolve_cost_model(CLUSTER, Mesh(("pp", "dp", "mp"), (2, 2, 2)))
    for pp, dp, tp in [(1, 8, 1), (1, 4, 2), (1, 2, 4), (2, 4, 1), (2, 2, 2), (2, 1, 4), (4, 2, 1), (4, 1, 2),
                       (8, 1, 1)]:
        alt = search_pipeline(lambda t: pipe["stage_costs"][t], 8, cfg.batch, cost, pp=pp, dp=dp, tp=tp,
                              memory_limit=CLUSTER.gpu.memory_capacity_bytes).best
        assert est.step_s <= alt.step_s * (1 + 1e-9), (pp, dp, tp)


def test_errors_name_the_fix(step):
    with pytest.raises(sp.ShardingError, match="no pipeline axis 'stages'"):
        plan(step, ((2, 4), ("dp", "mp")), pipeline=sp.Pipeline(microbatches=2, axis="stages"))
    with pytest.raises(sp.ShardingError, match="shard_params"):
        plan(step, ((2, 2, 2), ("pp", "dp", "mp")), shard_params=True)
    fn, args = step
    with pytest.raises(sp.ShardingError, match="returns no loss"):
        sp.plan_step(lambda p, s, t, u: (p, s), args, mesh=((2, 2, 2), ("pp", "dp", "mp")), cost_model=CLUSTER,
                     pipeline=sp.Pipeline(microbatches=2))


SCRIPT = '''
import sys
sys.path.insert(0, {examples!r})
import gpt_plan

def make_step():
    cfg = gpt_plan.GPT(layers=4, hidden=256, heads=8, seq=64, vocab=512, batch=32, remat=False)
    step, args = gpt_plan.train_step_and_args(cfg)
    return step, args, {{"tokens": cfg.batch * cfg.seq}}
'''


@pytest.mark.slow
def test_shardprop_plan_with_a_pp_axis(tmp_path, capsys):
    from shardprop.compiler.cli import main
    script = tmp_path / "model.py"
    script.write_text(SCRIPT.format(examples=str(ROOT / "examples")))
    figures = tmp_path / "plan.json"
    assert main(["plan", f"{script}:make_step", "--mesh", "2x2x2:pp,dp,mp", "--cluster", "1x8:a100-80gb",
                 "--microbatches", "4", "--schedule", "1f1b", "-o", str(tmp_path / "plan.html"),
                 "--json", str(figures)]) == 0
    text = capsys.readouterr().out
    assert "pp=2 x dp=2 x mp=2 (8 devices)" in text and "2 stages x 4 micro-batches" in text and "MFU" in text
    data = json.loads(figures.read_text())
    assert data["pipeline"]["pp"] == 2 and data["pipeline"]["schedule"] == "1f1b"
    assert math.isclose(data["step_s"], data["pipeline"]["pipeline_s"] + data["pipeline"]["sync_s"], rel_tol=1e-9)
