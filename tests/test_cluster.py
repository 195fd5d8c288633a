"""Nodes and links (issue 28, milestone 2): sp.Cluster as a cost model; axes inside a
node on NVLink, across nodes on the NIC, spanning both hierarchical; GPU profiles with
their sources; the default model untouched."""
import dataclasses
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
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
NV = A100.nvlink_bytes_per_s * A100.nvlink_efficiency    # what a collective moves over NVLink


def test_profiles_carry_a_source_for_every_number():
    for name in GPUS:
        data = json.loads((PROFILES / f"{name}.json").read_text())
        numbers = [k for k, v in data.items() if isinstance(v, (int, float))]
        assert set(numbers) <= set(data["sources"]), name
        assert all(isinstance(data["sources"][k], str) and len(data["sources"][k]) > 20 for k in numbers)
        # every point of the matmul-efficiency curve names its published measurement
        points, sources = data["matmul_efficiency"], data["sources"]["matmul_efficiency"]
        assert len(points) >= 1 and len(sources) == len(points), name
        assert all(isinstance(s, str) and "TFLOPS" in s for s in sources)
        g = GpuProfile.builtin(name)
        assert g.matmul_flops_per_s > 1e14 and g.nvlink_bytes_per_s > g.nic_bytes_per_s
        assert g.matmul_flops_per_s >= g.fp32_matmul_flops_per_s >= g.fp32_flops_per_s > 0
    assert A100.matmul_flops_per_s == 312e12 and A100.memory_bytes_per_s == 2039e9


def test_matmul_efficiency_curve_is_monotone_in_size_and_a_fraction():
    for name in GPUS:
        g = GpuProfile.builtin(name)
        eff = [g.matmul_efficiency(f) for f in np.logspace(3, 15, 121)]
        assert all(0 < e <= 1 for e in eff), name
        assert all(a <= b * (1 + 1e-12) for a, b in zip(eff, eff[1:])), name
        assert eff[0] < 0.01            # a tiny matmul is its launch overhead
        for flops, fraction in g.matmul_efficiency_points:   # the published points, at their sizes
            assert g.matmul_efficiency(flops) == pytest.approx(fraction)
        assert eff[-1] == pytest.approx(g.matmul_efficiency_points[-1][1])
    with pytest.raises(sp.ShardingError, match="non-decreasing"):
        dataclasses.replace(A100, matmul_efficiency_points=((1e9, 0.9), (1e10, 0.8)))


def test_a_large_gemm_on_a100_takes_its_flops_over_peak_times_the_curve():
    cost = sp.Cluster(1, 8).cost_model()
    n = 8192
    flops, touched = 2.0 * n ** 3, 3 * 2 * n * n          # bf16 operands and result
    curve = A100.matmul_efficiency(flops)
    assert curve == pytest.approx(271.2 / 312, abs=1e-4)     # the published A100 point
    assert cost.compute_time(flops, touched, contraction=True, unit="matmul") == pytest.approx(
        flops / (A100.matmul_flops_per_s * curve))
    # a float32 matmul at the float32 matmul peak (TF32), the same curve
    assert cost.compute_time(flops, 2 * touched, contraction=True, unit="matmul_fp32") == pytest.approx(
        flops / (156e12 * curve))
    # elementwise work: its bytes at the HBM bandwidth a streaming kernel reaches (the cited
    # measurement, 1.80 of the datasheet's 2.039 TB/s), or its flops at the CUDA cores' float32 peak
    elements = 2 ** 28
    assert A100.streaming_bytes_per_s == 1.80e12
    assert cost.compute_time(elements, 28 * elements, unit="vector") == pytest.approx(28 * elements / 1.80e12)
    assert cost.compute_time(1000 * elements, 28 * elements, unit="vector") == pytest.approx(1000 * elements / 19.5e12)


def test_matmuls_are_priced_by_their_operands_dtype():
    from shardprop.passes.cost import compute_unit, modeled_step_time
    n = 4096

    def compute_s(dtype):
        fn = lambda a, b: a @ b       # noqa: E731
        args = [jax.ShapeDtypeStruct((n, n), dtype)] * 2
        plan = sp.parallelize(fn, mesh=AbstractMesh((1, 8), ("dp", "mp"))).plan(*args)
        assert {compute_unit(op) for op in plan.graph.ops if op.kind == "dot_general"} == \
            {"matmul" if dtype == jnp.bfloat16 else "matmul_fp32"}
        return modeled_step_time(plan.graph, sp.Cluster(1, 8).cost_model())["compute"]
    assert compute_s(jnp.float32) / compute_s(jnp.bfloat16) == pytest.approx(312 / 156, rel=0.05)


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
            + 2 * (k - 1) / k * B / NV + 2 * (nodes - 1) / nodes * (B / k) / A100.nic_bytes_per_s)
    assert got == pytest.approx(want, rel=1e-12)
    # inside a node and one per node: the ring on NVLink, on the NIC
    intra = cost.collective_time(wire_bytes("all_reduce", B, 8), "all_reduce", ("mp",), Mesh(("dp", "mp"), (128, 8)))
    assert intra == pytest.approx(A100.nvlink_latency_s + 2 * 7 / 8 * B / NV)
    inter = cost.collective_time(wire_bytes("all_reduce", B, 16), "all_reduce", ("dp",), m)
    assert inter == pytest.approx(A100.nic_latency_s + 2 * 15 / 16 * B / A100.nic_bytes_per_s)
    # hierarchical beats a flat ring whose every step crosses the NIC
    assert got < A100.nic_latency_s + wire_bytes("all_reduce", B, n) / A100.nic_bytes_per_s
    for kind in ("reduce_scatter", "all_gather", "all_to_all"):
        lat, secs = hierarchical_time(kind, 1e9, 64, 8, A100)
        assert secs > 0 and lat > 0


def test_flat_ring_collectives_cross_the_nodes_nics_every_step():
    m = Mesh(("dp", "mp"), (16, 64))        # mp: 8 GPUs in each of 8 nodes
    B = 256 * 2 ** 20
    wire = wire_bytes("all_reduce", B, 64)
    ring = sp.Cluster(128, 8, collectives="ring").cost_model()
    got = ring.collective_time(wire, "all_reduce", ("mp",), m)
    assert got == pytest.approx(A100.nic_latency_s + wire / min(NV, 8 * A100.nic_bytes_per_s))
    # the ring pipelines NVLink and NIC hops where the hierarchical form runs them one after
    # another: with a NIC per GPU it is the faster; with one NIC per node, the slower
    hier = sp.Cluster(128, 8).cost_model().collective_time(wire, "all_reduce", ("mp",), m)
    assert got < hier
    one_nic = dataclasses.replace(A100, nic_bytes_per_s=12.5e9 / 8)
    assert sp.Cluster(128, 8, one_nic, "ring").cost_model().collective_time(wire, "all_reduce", ("mp",), m) > \
        sp.Cluster(128, 8, one_nic).cost_model().collective_time(wire, "all_reduce", ("mp",), m)
    # inside a node and one per node the two agree
    for axes, mesh in ((("mp",), Mesh(("dp", "mp"), (128, 8))), (("dp",), m)):
        assert ring.collective_time(wire, "all_reduce", axes, mesh) == pytest.approx(
            sp.Cluster(128, 8).cost_model().collective_time(wire, "all_reduce", axes, mesh))
    with pytest.raises(sp.ShardingError, match="collectives="):
        sp.Cluster(2, 8, collectives="tree")


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


@pytest.mark.slow   # > 1.5 s: plans a 128-device step
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
    # the GPU units are a cluster's: the default and the measured CPU models price every op on their roofline
    for model in (DEFAULT_COST, sp.CostModel.builtin("cpu")):
        assert not model.prices_units
        for unit in ("matmul", "matmul_fp32", "vector"):
            assert model.compute_time(1e9, 1e7, True, unit=unit) == model.compute_time(1e9, 1e7, True)
    assert DEFAULT_COST.compute_time(1e9, 1e7, True) == pytest.approx(max(1e9 / 200e12, 1e7 / 2e12))


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


@pytest.mark.slow   # > 1.5 s: plans a 128-device step
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


def test_a_dgx1_group_gets_only_the_nvlinks_between_its_members():
    from shardprop.passes.cluster import node_groups
    v100 = GpuProfile.builtin("v100-32gb")
    assert all(sum(row) == 6 for row in v100.nvlink_links)          # six links per V100
    assert v100.group_nvlink_bytes_per_s(range(8)) == 150e9          # the whole cube mesh
    assert v100.group_nvlink_bytes_per_s((0, 1)) == 25e9             # one link between them
    assert v100.group_nvlink_bytes_per_s((0, 3)) == 50e9             # a doubled edge
    assert v100.group_nvlink_bytes_per_s((0, 1, 2, 3)) == 100e9      # a face with its diagonals: 4 links each
    assert A100.group_nvlink_bytes_per_s((0, 1)) == A100.nvlink_bytes_per_s   # NVSwitch: every pair at full speed
    # the groups of a (dp 4, mp 2) mesh in one node, by its row-major layout
    mesh = Mesh(("dp", "mp"), (4, 2))
    assert node_groups(group_shape(("mp",), mesh), 8) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert node_groups(group_shape(("dp",), mesh), 8) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    # an all_reduce over mp runs at the slowest pair's single link; over the whole node at all six
    cost = sp.Cluster(1, 8, "v100-32gb").cost_model()
    nbytes = 1e9
    assert v100.nvlink_efficiency == 0.8                              # NCCL's 20 of a link's 25 GB/s
    for axes, bw in ((("mp",), 0.8 * 25e9), (("dp", "mp"), 0.8 * 150e9)):
        n = mesh.axes_size(axes)
        wire = wire_bytes("all_reduce", nbytes, n)
        assert cost.collective_time(wire, "all_reduce", axes, mesh) == pytest.approx(
            v100.nvlink_latency_s + wire / bw)
    with pytest.raises(sp.ShardingError, match="symmetric"):
        dataclasses.replace(v100, nvlink_links=((0, 1), (2, 0)))


@pytest.mark.slow
def test_the_published_runs_gpt_has_their_dropout_and_biases():
    import gpt_plan

    def plan(**kw):
        cfg = gpt_plan.GPT(layers=2, hidden=64, heads=4, seq=32, vocab=128, batch=8, compute_dtype="float16", **kw)
        step, args = gpt_plan.train_step_and_args(cfg)
        assert sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(args[0])) == cfg.params
        return sp.plan_step(step, args, mesh=AbstractMesh((2, 4), ("dp", "mp")),
                            cost_model=sp.Cluster(1, 8, "v100-32gb"))
    plain, run = plan(), plan(dropout=0.1, bias=True)
    # a byte of random bits per element of the embeddings, every layer's attention
    # probabilities and its two residual branches: drawn again when the layer is recomputed
    draws = [op for op in run.plan.graph.ops if op.kind == "random_bits"]
    assert len(draws) == 1 + 2 * 2 * 3 and all(op.outputs[0].type.dtype == "uint8" for op in draws)
    assert run.step_s > plain.step_s and run.flops > plain.flops
