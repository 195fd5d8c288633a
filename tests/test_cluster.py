"""Nodes and links (issue 28, milestone 2): sp.Cluster as a cost model; axes inside a
node on NVLink, across nodes on the NIC, spanning both hierarchical; GPU profiles with
their sources; the default model untouched."""
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import shardprop as sp
from shardprop.ir.mesh import Mesh
from shardprop.passes.cluster import GPUS, GpuProfile, hierarchical_time, intra_node_members
from shardprop.passes.cost import DEFAULT_COST, PROFILES, group_shape, resolve_cost_model, wire_bytes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
A100 = GpuProfile.builtin("a100-80gb")


def test_profiles_carry_a_source_for_every_number():
    for name in GPUS:
        data = json.loads((PROFILES / f"{name}.json").read_text())
        numbers = [k for k, v in data.items() if isinstance(v, (int, float))]
        assert set(numbers) <= set(data["sources"]), name
        g = GpuProfile.builtin(name)
        assert g.matmul_flops_per_s > 1e14 and g.nvlink_bytes_per_s > g.nic_bytes_per_s
    assert A100.matmul_flops_per_s == 312e12 and A100.memory_bytes_per_s == 2039e9


def test_matmul_efficiency_grows_with_size():
    small, large = A100.matmul_efficiency(1e9), A100.matmul_efficiency(1e13)
    assert 0 < small < 0.5 < large < 1


def test_axes_map_to_nodes_as_make_mesh_lays_them_out():
    cost = sp.Cluster(128, 8).cost_model()
    m = Mesh(("dp", "mp"), (128, 8))       # trailing axis fastest: mp inside a node
    assert cost.link_class(("mp",), m) == "intra" and cost.link_class(("dp",), m) == "inter"
    swapped = Mesh(("mp", "dp"), (8, 128))
    assert cost.link_class(("mp",), swapped) == "inter" and cost.link_class(("dp",), swapped) == "both"
    m = Mesh(("dp", "mp"), (16, 64))       # mp = 8 GPUs in each of 8 nodes
    assert cost.split(("mp",), m) == (64, 8) and cost.link_class(("mp",), m) == "both"
    assert intra_node_members(group_shape(("dp", "mp"), m), 8) == 8
    assert intra_node_members(((4, 2),), 8) == 4          # every other GPU of a node


def test_hierarchical_all_reduce_matches_its_formula():
    cost = sp.Cluster(128, 8).cost_model()
    m = Mesh(("dp", "mp"), (16, 64))
    B = 256 * 2 ** 20
    n, k, nodes = 64, 8, 8
    got = cost.collective_time(wire_bytes("all_reduce", B, n), "all_reduce", ("mp",), m)
    want = (2 * A100.nvlink_latency_s + A100.nic_latency_s
            + 2 * (k - 1) / k * B / A100.nvlink_bytes_per_s + 2 * (nodes - 1) / nodes * (B / k) / A100.nic_bytes_per_s)
    assert got == pytest.approx(want, rel=1e-12)
    # inside a node and one per node: the ring on NVLink, on the NIC
    intra = cost.collective_time(wire_bytes("all_reduce", B, 8), "all_reduce", ("mp",), Mesh(("dp", "mp"), (128, 8)))
    assert intra == pytest.approx(A100.nvlink_latency_s + 2 * 7 / 8 * B / A100.nvlink_bytes_per_s)
    inter = cost.collective_time(wire_bytes("all_reduce", B, 16), "all_reduce", ("dp",), m)
    assert inter == pytest.approx(A100.nic_latency_s + 2 * 15 / 16 * B / A100.nic_bytes_per_s)
    # hierarchical beats a flat ring whose every step crosses the NIC
    assert got < A100.nic_latency_s + wire_bytes("all_reduce", B, n) / A100.nic_bytes_per_s
    for kind in ("reduce_scatter", "all_gather", "all_to_all"):
        lat, secs = hierarchical_time(kind, 1e9, 64, 8, A100)
        assert secs > 0 and lat > 0


def test_cluster_must_hold_the_mesh_and_parses():
    with pytest.raises(sp.ShardingError, match="needs 2048 devices but the cluster has 1024"):
        resolve_cost_model(sp.Cluster(128, 8), Mesh(("dp", "mp"), (32, 64)))
    c = sp.Cluster.parse("128x8:h100-80gb")
    assert c.devices == 1024 and c.gpu.name == "h100-80gb"
    with pytest.raises(sp.ShardingError, match="NODESxGPUS_PER_NODE"):
        sp.Cluster.parse("lots")
    with pytest.raises(sp.ShardingError, match="built-in GPU"):
        sp.Cluster(2, 8, "tpu")
    assert resolve_cost_model(None, Mesh(("d",), (8,))) is DEFAULT_COST


def _small_gpt(**kw):
    import gpt_plan
    cfg = gpt_plan.GPT(**{**dict(layers=2, hidden=1024, heads=16, seq=512, vocab=8192, batch=256), **kw})
    step, args = gpt_plan.train_step_and_args(cfg)
    return cfg, step, args


def test_tensor_parallel_inside_nodes_is_priced_faster_than_across():
    from shardprop.passes.cost import modeled_step_time
    cfg, step, args = _small_gpt()
    cluster = sp.Cluster(16, 8)
    inside = sp.plan_step(step, args, mesh=AbstractMesh((16, 8), ("dp", "mp")), cost_model=cluster)
    assert {"intra-node", "inter-node"} <= set(inside.link_bytes)
    # the same plan with its axes laid out the other way round: mp across nodes, dp spanning both
    graph, cost = inside.plan.graph, cluster.cost_model()
    t_inside = modeled_step_time(graph, cost)
    graph.set_mesh(Mesh(("mp", "dp"), (8, 16)))
    t_across = modeled_step_time(graph, cost)
    assert t_inside["compute"] == pytest.approx(t_across["compute"])
    assert t_inside["communication"] < t_across["communication"] / 2
    # planned for each layout, tp inside nodes still wins
    across = sp.plan_step(step, args, mesh=AbstractMesh((8, 16), ("mp", "dp")), cost_model=cluster)
    assert inside.step_s < across.step_s
    assert "both (hierarchical)" in across.link_bytes


def test_plan_estimate_reports_memory_links_and_throughput():
    cfg, step, args = _small_gpt()
    est = sp.plan_step(step, args, mesh=AbstractMesh((16, 8), ("dp", "mp")), cost_model=sp.Cluster(16, 8),
                       tokens=cfg.batch * cfg.seq)
    text = str(est)
    for word in ("parameters", "gradients", "optimizer state", "activations", "peak", "intra-node",
                 "inter-node", "tokens/s", "TFLOP/s", "MFU"):
        assert word in text
    assert 0 < est.mfu < 1 and est.tokens_per_s > 0
    # mixed precision: fp32 master weights split over mp (the embedding by vocabulary)
    h = cfg.hidden
    want = 4 * (cfg.layers * (12 * h * h // 8 + 4 * h) + cfg.vocab * h // 8 + cfg.seq * h + 2 * h)
    assert est.param_bytes == pytest.approx(want, rel=0.02)
    assert est.optimizer_bytes == pytest.approx(2 * want, rel=0.02)


@pytest.mark.slow
def test_recomputation_is_counted_in_flops():
    _, step, args = _small_gpt(remat=False)
    _, step_r, args_r = _small_gpt(remat=True)
    mesh = AbstractMesh((16, 8), ("dp", "mp"))
    plain = sp.plan_step(step, args, mesh=mesh, cost_model=sp.Cluster(16, 8))
    remat = sp.plan_step(step_r, args_r, mesh=mesh, cost_model=sp.Cluster(16, 8))
    assert remat.flops > 1.1 * plain.flops       # the layers' forward again in the backward
    assert remat.activation_bytes < plain.activation_bytes


def test_default_cost_model_prices_as_before():
    m = Mesh(("dp", "mp"), (2, 4))
    assert DEFAULT_COST.collective_time(1e6, "all_reduce", ("mp",), m) == pytest.approx(5e-6 + 1e6 / 100e9)


SCRIPT = '''
import sys
sys.path.insert(0, {examples!r})
import gpt_plan

def make_step():
    cfg = gpt_plan.GPT(layers=2, hidden=1024, heads=16, seq=512, vocab=8192, batch=256)
    step, args = gpt_plan.train_step_and_args(cfg)
    return step, args, {{"tokens": cfg.batch * cfg.seq}}

def not_a_step():
    return 3
'''


def test_shardprop_plan_command(tmp_path, capsys):
    from shardprop.compiler.cli import main
    script = tmp_path / "model.py"
    script.write_text(SCRIPT.format(examples=str(ROOT / "examples")))
    out = tmp_path / "plan.html"
    figures = tmp_path / "plan.json"
    assert main(["plan", f"{script}:make_step", "--mesh", "16x8:dp,mp", "--cluster", "16x8:a100-80gb",
                 "-o", str(out), "--json", str(figures)]) == 0
    text = capsys.readouterr().out
    assert "dp=16 x mp=8 (128 devices)" in text and "intra-node" in text and "MFU" in text and "tokens/s" in text
    assert out.read_text().startswith("<!DOCTYPE html") or "<html" in out.read_text()[:500]
    data = json.loads(figures.read_text())
    assert data["devices"] == 128 and data["memory_per_device_bytes"]["parameters"] > 0
    assert main(["plan", f"{script}:not_a_step", "--mesh", "16x8:dp,mp"]) == 1
    assert "must return (step_fn, args)" in capsys.readouterr().err
    assert main(["plan", f"{script}:make_step", "--mesh", "16x8"]) == 1


def test_auto_keeps_to_the_clusters_memory():
    _, step, args = _small_gpt(layers=1, hidden=256, heads=4, seq=64, vocab=512, batch=8, remat=False)
    mesh = AbstractMesh((2, 4), ("dp", "mp"))
    pstep = sp.parallelize(step, mesh=mesh, mode="auto", cost_model=sp.Cluster(1, 8))
    assert pstep.options.memory_limit == A100.memory_capacity_bytes
    assert sp.parallelize(step, mesh=mesh, mode="auto", cost_model=sp.Cluster(1, 8),
                          memory_limit="1GiB").options.memory_limit == 2 ** 30      # the user's wins


@pytest.mark.slow
def test_auto_says_when_nothing_fits_the_clusters_memory():
    import dataclasses
    _, step, args = _small_gpt(layers=1, hidden=256, heads=4, seq=64, vocab=512, batch=8, remat=False)
    mesh = AbstractMesh((2, 4), ("dp", "mp"))
    tiny = dataclasses.replace(A100, memory_capacity_bytes=2 ** 20)
    with pytest.raises(sp.ShardingError, match="no plan fits memory_limit=1,048,576 bytes"):
        sp.plan_step(step, args, mesh=mesh, cost_model=sp.Cluster(1, 8, tiny), mode="auto")
