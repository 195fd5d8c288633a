"""The cost model: per-group alpha-beta, profiles (save/load, built-in, wrong mesh),
``shardprop calibrate``, and a latency term that changes what the planner does."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardprop as sp
from jax.sharding import PartitionSpec as P
from shardprop.ir.layout import Layout
from shardprop.ir.mesh import Mesh
from shardprop.passes.cost import (DEFAULT_COST, ComputeTimes, CostModel, Link, combined_collectives, group_shape,
                                   modeled_step_time, resolve_cost_model, wire_bytes)
from shardprop.passes.fusion import resident_values
from shardprop.passes.redistribute import plan_redistribution, redistribution_cost
from tests import golden_nets

MESH_2x4 = Mesh(("a", "b"), (2, 4))
MESH_8 = Mesh(("d0", "d1", "d2"), (2, 2, 2))


def test_group_shape_names_ranks_not_axes():
    # a 2x4 mesh's axis of 4 is the same devices as the 2x2x2 mesh's two minor axes
    assert group_shape(("b",), MESH_2x4) == group_shape(("d1", "d2"), MESH_8) == ((4, 1),)
    assert group_shape(("a",), MESH_2x4) == group_shape(("d0",), MESH_8) == ((2, 4),)
    assert group_shape(("a", "b"), MESH_2x4) == group_shape(("d2", "d0", "d1"), MESH_8) == ((8, 1),)
    assert group_shape(("d0", "d2"), MESH_8) == ((2, 1), (2, 4))   # not one run of ranks


def test_links_are_looked_up_per_group_and_kind():
    slow_a, fast_b = Link(1e-3, 1e9), Link(1e-6, 1e11)
    model = CostModel(links=((((2, 4),), "", slow_a), (((4, 1),), "", fast_b),
                             (((4, 1),), "all_gather", Link(2e-6, 1e11))), device_count=8)
    assert model.collective_time(1e6, "all_reduce", ("a",), MESH_2x4) == pytest.approx(1e-3 + 1e-3)
    assert model.collective_time(1e6, "all_reduce", ("b",), MESH_2x4) == pytest.approx(1e-6 + 1e-5)
    assert model.collective_time(0, "all_gather", ("b",), MESH_2x4) == pytest.approx(2e-6)   # its kind's own fit
    # a group never measured as a whole: its slowest run's latency and bandwidth
    assert model.collective_time(1e6, "all_reduce", ("a", "b"), MESH_2x4) == pytest.approx(1e-3 + 1e-3)
    # without axes (callers that do not say) the model's single figures hold
    assert model.collective_time(1e6) == pytest.approx(DEFAULT_COST.collective_time(1e6))
    # a measured wait for the group after compute is added to every priced collective
    waits = CostModel(links=model.links, device_count=8, sync_s=3e-4)
    assert waits.collective_time(1e6, "all_reduce", ("b",), MESH_2x4) == pytest.approx(3e-4 + 1e-6 + 1e-5)


def test_the_wait_after_compute_is_the_groups_and_paid_once_per_move():
    # measured per group: a collective over a waits a's, over b b's; a group never measured
    # as a whole waits as its slowest measured axis; one with no measured group, sync_s
    links = ((((2, 4),), "", Link(1e-5, 1e9)), (((4, 1),), "", Link(1e-5, 1e9)))
    model = CostModel(links=links, device_count=8, sync_s=9e-4, waits=((((2, 4),), 3e-4), (((4, 1),), 1e-4)))
    assert model.collective_time(0, "all_gather", ("a",), MESH_2x4) == pytest.approx(3e-4 + 1e-5)
    assert model.collective_time(0, "all_gather", ("b",), MESH_2x4) == pytest.approx(1e-4 + 1e-5)
    assert model.wait(("a", "b"), MESH_2x4) == pytest.approx(3e-4)
    assert CostModel(links=links, device_count=8, sync_s=9e-4).wait(("b",), MESH_2x4) == pytest.approx(9e-4)
    # a collective right after another pays none; at the step's end riders share one
    assert model.back_to_back.wait(("a",), MESH_2x4) == 0.0
    assert model.at_step_end(4).wait(("a",), MESH_2x4) == pytest.approx(3e-4 / 4)
    assert model.with_sync_share(3).wait(("b",), MESH_2x4) == pytest.approx(1e-4 / 3)
    # a move of two steps (gather over a, then all_to_all over b) waits once: its first step's
    src, dst = Layout((("a",), ("b",))), Layout((("b",), ("a",)))
    steps = plan_redistribution((16, 16), 4, src, dst, MESH_2x4, True, model)
    kinds = [(s.kind, s.param("axes")) for s in steps if s.kind != "slice"]
    assert kinds == [("all_gather", ("a",)), ("all_to_all", ("b",))]
    each = sum(model.step_time(s, MESH_2x4) for s in steps)
    assert redistribution_cost((16, 16), 4, src, dst, MESH_2x4, True, model) == pytest.approx(each - 1e-4)
    # the profile round-trips its waits
    assert CostModel.from_dict(model.to_dict()).waits == model.waits


def test_a_collective_of_a_collectives_result_pays_no_wait_in_the_modeled_step():
    # x split over a and b, wanted split the other way round: the planned program moves it
    # in two collectives, the second taking the first's result with no compute between
    links = ((((2, 4),), "", Link(1e-5, 1e9)), (((4, 1),), "", Link(1e-5, 1e9)))
    waits = CostModel(links=links, device_count=8, waits=((((2, 4),), 3e-4), (((4, 1),), 1e-4)))
    plain = CostModel(links=links, device_count=8)
    f = sp.shard(lambda x: x * 2.0, (P("b", "a"),))
    plan = sp.parallelize(lambda x: f(sp.shard(lambda y: y + 1.0, (P("a", "b"),))(x)),
                          mesh=((2, 4), ("a", "b")), cost_model=waits).plan(np.ones((16, 16), np.float32))
    from shardprop.ir.graph import is_collective
    chain = [op for op in plan.graph.ops if is_collective(op) and op.kind != "slice"]
    assert len(chain) >= 2, [op.kind for op in plan.graph.ops]
    extra = modeled_step_time(plan.graph, waits)["communication"] - modeled_step_time(plan.graph, plain)["communication"]
    first = chain[0].params["axes"]
    assert extra == pytest.approx(waits.wait(tuple(first), MESH_2x4)), [(op.kind, op.params["axes"]) for op in chain]


def test_default_model_prices_as_before():
    # the default model has no links: every planner cost is the old single alpha-beta
    for kind, axes in (("all_reduce", ("a",)), ("all_gather", ("a", "b")), ("permute", ("a", "b"))):
        w = wire_bytes(kind, 4096, MESH_2x4.axes_size(axes))
        assert DEFAULT_COST.collective_time(w, kind, axes, MESH_2x4) == DEFAULT_COST.latency_s + w / 100e9


def test_planner_prices_bundled_axes_as_the_real_group():
    # the planner bundles axes that travel together into one virtual axis; a profile must
    # still price the move by the real devices it runs over
    model = CostModel(links=((((8, 1),), "", Link(7e-3, 1e9)), (((2, 4),), "", Link(1e-6, 1e12)),
                             (((4, 1),), "", Link(1e-6, 1e12))), device_count=8)
    src, dst = Layout((("a", "b"), ())), Layout(((), ()))
    steps = plan_redistribution((16, 16), 4, src, dst, MESH_2x4, True, model)
    assert [(s.kind, s.param("axes")) for s in steps] == [("all_gather", ("a", "b"))]
    assert redistribution_cost((16, 16), 4, src, dst, MESH_2x4, True, model) == pytest.approx(
        7e-3 + steps[0].wire_bytes / 1e9)


def test_latency_term_changes_a_redistribution():
    # a sum pending over a, wanted split over (a, b) on dim 1: with no latency, slice b,
    # reduce-scatter a quarter of the bytes and move them with an all_to_all (224 B, two
    # collectives); where a collective's latency dominates, one collective over a (a
    # reduce_scatter of 512 B, or an all_reduce where the profile prices that lower)
    src, dst = Layout(((), ()), ("a",)), Layout(((), ("a", "b")))
    no_latency = plan_redistribution((16, 16), 4, src, dst, MESH_2x4, True, CostModel(latency_s=0.0))
    cpu = plan_redistribution((16, 16), 4, src, dst, MESH_2x4, True, CostModel.builtin("cpu", MESH_2x4))
    kinds = lambda steps: [s.kind for s in steps if s.kind != "slice"]  # noqa: E731
    assert kinds(no_latency) == ["reduce_scatter", "all_to_all"]
    assert sum(s.wire_bytes for s in no_latency) == 224
    assert len(kinds(cpu)) == 1 and cpu[0].param("axes") == ("a",)
    assert kinds(plan_redistribution((16, 16), 4, src, dst, MESH_2x4, True, CostModel(latency_s=1e-3))) == \
        ["reduce_scatter"]


def test_save_load_round_trip(tmp_path):
    model = CostModel(latency_s=3e-5, link_bytes_per_s=2e9, flops_per_s=1e10, memory_bytes_per_s=4e9,
                      contraction_bytes_per_s=1.5e9, sync_s=4e-4, memory_capacity_bytes=16 << 30,
                      links=((((2, 4),), "all_reduce", Link(4e-5, 1e9)), (((4, 1),), "", Link(2e-5, 3e9))),
                      device_count=8, mesh_shape=(2, 4), mesh_axes=("d0", "d1"), device_kind="cpu:cpu", name="mine")
    path = tmp_path / "profile.json"
    model.save(path)
    assert json.loads(path.read_text())["schema"] == "shardprop.cost/1"
    back = CostModel.load(path)
    assert back == model and hash(back) == hash(model)
    assert back.collective_time(1e5, "all_reduce", ("a",), MESH_2x4) == model.collective_time(
        1e5, "all_reduce", ("a",), MESH_2x4)
    builtin = CostModel.builtin("cpu")
    builtin.save(tmp_path / "cpu.json")
    assert CostModel.load(tmp_path / "cpu.json") == builtin


def test_profile_for_another_mesh_is_refused(tmp_path):
    with pytest.raises(sp.ShardingError, match="(?s)cannot price a mesh of 4 devices.*shardprop calibrate --mesh 2x2"):
        CostModel.builtin("cpu", Mesh(("d0", "d1"), (2, 2)))
    # measured on a 2x4 mesh: the 2x2x2 mesh's minor axes are groups it never timed
    only_2x4 = CostModel(links=tuple((group_shape(axes, MESH_2x4), "", Link(1e-5, 1e9))
                                     for axes in (("a",), ("b",), ("a", "b"))), device_count=8,
                         mesh_shape=(2, 4), mesh_axes=("a", "b"))
    only_2x4.check_mesh(Mesh(("dp", "mp"), (2, 4)))   # same devices, other names: fine
    with pytest.raises(sp.ShardingError, match=r"no measurement for the device groups of mesh axes \['d1', 'd2'\]"):
        only_2x4.check_mesh(MESH_8)
    with pytest.raises(sp.ShardingError, match="cannot price a mesh of 4 devices"):
        sp.parallelize(golden_nets.seed_net, mesh=4, cost_model="cpu")
    path = tmp_path / "p.json"
    only_2x4.save(path)
    with pytest.raises(sp.ShardingError, match="no measurement"):
        CostModel.load(path, MESH_8)


def test_bad_profiles_and_names_are_clear_errors(tmp_path):
    with pytest.raises(sp.ShardingError, match="no built-in cost profile 'tpu'.*'cpu', 'h100'"):
        sp.parallelize(golden_nets.seed_net, mesh=8, cost_model="tpu")
    with pytest.raises(sp.ShardingError, match="not a CostModel"):
        sp.parallelize(golden_nets.seed_net, mesh=8, cost_model=3.0)
    with pytest.raises(sp.ShardingError, match="no cost profile at"):
        CostModel.load(tmp_path / "missing.json")
    (tmp_path / "plan.json").write_text(json.dumps({"schema": "shardprop.plan/1"}))
    with pytest.raises(sp.ShardingError, match="not a shardprop cost profile"):
        CostModel.load(tmp_path / "plan.json")
    with pytest.raises(sp.ShardingError, match="one NVLink node of 8 GPUs"):
        resolve_cost_model("h100", Mesh(("dp", "mp"), (4, 4)))


def test_builtin_profiles_plan_and_compute_right():
    args = golden_nets.seed_args()
    want = jax.jit(golden_nets.seed_net)(*args)
    for name in ("cpu", "h100"):
        got = sp.parallelize(golden_nets.seed_net, mesh=8, cost_model=name, progress=False)(*args)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    h100 = CostModel.builtin("h100")
    assert h100.memory_capacity_bytes == 80 * 10**9 and h100.device_count is None


def test_modeled_step_time_counts_collectives_and_compute():
    args = golden_nets.seed_args()
    plan = sp.parallelize(golden_nets.seed_net, mesh=8, progress=False).plan(*args)
    t = modeled_step_time(plan.graph, DEFAULT_COST)
    assert t["collectives"] == len([c for c in plan.collectives if c.kind != "slice"]) >= 1
    assert t["communication"] == pytest.approx(sum(DEFAULT_COST.collective_time(c.bytes) for c in plan.collectives
                                                   if c.kind != "slice"))   # a local slice moves nothing
    assert 0 < t["compute"] < t["total"]


def test_fused_elementwise_chain_touches_only_its_ends():
    # tanh(x * 2 + 1) @ w: XLA runs the multiply, add and tanh as one loop, reading x and
    # writing tanh's result; the two values between them never reach memory
    x, w = np.ones((64, 32), np.float32), np.ones((32, 16), np.float32)
    plan = sp.parallelize(lambda x, w: jnp.tanh(x * 2.0 + 1.0) @ w, mesh=8, mode="data_parallel",
                          batch_argnums=(0,), progress=False).plan(x, w)
    g = plan.graph
    ops = {op.kind: op for op in g.ops}
    resident = resident_values(g)
    assert resident == {ops["mul"].outputs[0], ops["add"].outputs[0]}   # tanh's result is the matmul's operand
    times = ComputeTimes(DEFAULT_COST, g.mesh, resident)
    local = 64 * 32 * 4 / 8   # one device's rows of x (and of each value of the chain)
    touched = {k: times.work(ops[k], ops[k].strategy.rule.flops, ops[k].strategy.factors)[1]
               for k in ("mul", "add", "tanh")}
    scalar = 4   # the literal 2.0 or 1.0 each reads
    assert touched == {"mul": local + scalar, "add": scalar, "tanh": local}
    # priced op by op (no fusion), every value is read and written
    unfused = ComputeTimes(DEFAULT_COST, g.mesh)
    assert unfused.work(ops["add"], ops["add"].strategy.rule.flops, ops["add"].strategy.factors)[1] == 2 * local + scalar
    # the step model counts the same
    assert modeled_step_time(g, DEFAULT_COST)["compute"] < sum(
        DEFAULT_COST.compute_time(*unfused.work(op, op.strategy.rule.flops, op.strategy.factors),
                                  contraction=op.kind == "dot_general") for op in g.ops if op.strategy is not None)


def test_independent_all_reduces_are_launched_together():
    # a data parallel step reduces each gradient over the batch axis; no reduction depends
    # on another, so XLA combines them into one launch: one latency, every gradient's bytes
    def loss(w1, w2, x):
        return jnp.sum(jnp.tanh(x @ w1) @ w2)
    args = (np.ones((32, 64), np.float32), np.ones((64, 8), np.float32), np.ones((16, 32), np.float32))
    plan = sp.parallelize(jax.grad(loss, argnums=(0, 1)), mesh=8, mode="data_parallel", batch_argnums=(2,),
                          progress=False).plan(*args)
    reductions = [c for c in plan.collectives if c.kind == "all_reduce"]
    assert len(reductions) == 2
    t = modeled_step_time(plan.graph, DEFAULT_COST)
    assert t["collectives"] == 2 and t["launched"] == 1
    assert t["communication"] == pytest.approx(DEFAULT_COST.latency_s + sum(c.bytes for c in reductions)
                                               / DEFAULT_COST.link_bytes_per_s)
    assert len(combined_collectives(plan.graph)) == 1
    # a reduction computed from another's result waits for it: two launches (the batch's
    # variance needs its mean first)
    def normalize(x):
        centered = x - jnp.mean(x, axis=0)
        return centered / jnp.sqrt(jnp.mean(centered * centered, axis=0) + 1e-5)
    chain = sp.parallelize(normalize, mesh=8, mode="data_parallel", batch_argnums=(0,),
                           progress=False).plan(np.ones((16, 32), np.float32))
    assert [c.kind for c in chain.collectives if c.kind != "slice"] == ["all_reduce", "all_reduce"]
    t = modeled_step_time(chain.graph, DEFAULT_COST)
    assert t["collectives"] == t["launched"] == 2 and not combined_collectives(chain.graph)


def _first_matmul(plan):
    return next(op for op in plan.graph.ops if op.kind == "dot_general")


def test_a_tensor_left_whole_is_read_whole_on_every_device():
    # x [16, 32] @ w1 [32, 16], batch split 8 ways (data parallel): each device reads its
    # 2 rows of x, all of w1, and writes 2 rows; work per device is not the whole op's / 8
    x, w1 = np.ones((16, 32), np.float32), np.ones((32, 16), np.float32)
    plan = sp.parallelize(lambda x, w1: x @ w1, mesh=8, mode="data_parallel", batch_argnums=(0,),
                          progress=False).plan(x, w1)
    op = _first_matmul(plan)
    flops, local = ComputeTimes(DEFAULT_COST, plan.graph.mesh).work(op, op.strategy.rule.flops, op.strategy.factors)
    assert flops == 2 * 16 * 32 * 16 / 8
    assert local == 4 * (16 * 32 / 8 + 32 * 16 + 16 * 16 / 8)


def test_contraction_streams_its_operands_where_measured():
    # a profile that measured operand streaming adds bytes to a matmul's flops; elementwise
    # ops and models without the term keep the roofline
    streaming = CostModel(flops_per_s=1e10, memory_bytes_per_s=4e9, contraction_bytes_per_s=1e9)
    assert streaming.compute_time(1e8, 1e6, contraction=True) == pytest.approx(1e-2 + 1e-3)
    assert streaming.compute_time(1e8, 1e6) == pytest.approx(max(1e-2, 1e6 / 4e9))
    assert DEFAULT_COST.compute_time(1e8, 1e6, contraction=True) == DEFAULT_COST.compute_time(1e8, 1e6)
    # so at equal flops a skinny per-device matmul (a batch split beside a whole weight)
    # costs more than a column split of the weight beside a whole activation
    x, w1, w2 = np.ones((4, 64, 256), np.float32), np.ones((256, 1024), np.float32), np.ones((1024, 256), np.float32)

    def mlp(x, w1, w2):
        return jax.nn.gelu(x @ w1) @ w2
    plans = {name: sp.parallelize(mlp, mesh=8, in_strategy=spec, progress=False).plan(x, w1, w2)
             for name, spec in (("rows", ((1, 8, 1), (1, 1), (1, 1))), ("columns", ((1, 1, 1), (1, 8), (8, 1))))}
    times = {}
    for name, plan in plans.items():
        op = _first_matmul(plan)
        times[name] = ComputeTimes(streaming, plan.graph.mesh).time(op, op.strategy.rule.flops, op.strategy.factors)
        assert op.strategy.rule.flops == 2 * 256 * 256 * 1024
    assert times["rows"] > times["columns"]


@pytest.mark.multiprocess
@pytest.mark.timeout(420)   # the CLI run may take up to 300 s
def test_calibrate_cli_writes_a_loadable_profile(tmp_path):
    out = tmp_path / "profile.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-m", "shardprop.compiler.cli", "calibrate", "--cpu", "--mesh", "2",
                          "--quick", "-o", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "wrote" in run.stdout
    model = CostModel.load(out, Mesh(("x",), (2,)))
    assert model.device_count == 2 and model.mesh_shape == (2,)
    kinds = {kind for group, kind, _ in model.links if group == ((2, 1),)}
    assert "" in kinds and kinds <= {"all_reduce", "all_gather", ""}   # a kind of its own where it differs
    assert all(link.latency_s > 0 and link.bytes_per_s > 0 for _, _, link in model.links)
    assert model.flops_per_s > 0 and model.memory_bytes_per_s > 0 and model.contraction_bytes_per_s > 0
    with pytest.raises(sp.ShardingError, match="cannot price a mesh of 8 devices"):
        model.check_mesh(MESH_8)


def test_wait_clock_counts_cpu_where_asked_and_devices_share_cores(monkeypatch):
    # --wait-clock cpu, forced CPU devices that outnumber the cores: a wait is timed by
    # the CPU it burns (a waiting device leaves its core to a sibling's work); otherwise,
    # and by default, by the wall clock a user waits for
    import time
    from shardprop.compiler import calibrate
    devices = jax.devices()
    monkeypatch.setattr(calibrate, "host_cores", lambda: len(devices) - 1)
    assert calibrate.wait_clock(devices) is time.perf_counter
    shared = calibrate.wait_clock(devices, "cpu")
    assert shared is not time.perf_counter
    t = shared()
    time.sleep(0.05)   # waiting burns no CPU: the shared clock barely moves
    assert shared() - t < 0.02
    monkeypatch.setattr(calibrate, "host_cores", lambda: len(devices))
    assert calibrate.wait_clock(devices, "cpu") is time.perf_counter
    with pytest.raises(ValueError, match="wall"):
        calibrate.wait_clock(devices, "sundial")


def test_bench_hlo_sums_a_trace_by_opcode():
    # where a step's time goes: profiler events named by HLO instruction, summed per opcode
    from bench.hlo import opcodes, time_by_opcode
    hlo = """
  %ynn_fusion.34 = f32[32,128]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation.34
  %dot.66 = f32[128,512]{1,0} dot(%c, %d), lhs_contracting_dims={0}, rhs_contracting_dims={1}
  %all-reduce = f32[8]{0} all-reduce(%e), replica_groups={{0,1}}, to_apply=%add
  %ag = (f32[2]{0}, f32[4]{0}) all-gather-start(%f), replica_groups={{0,1}}, dimensions={0}
"""
    assert opcodes(hlo) == {"ynn_fusion.34": "fusion:ynn_fusion", "dot.66": "dot", "all-reduce": "all-reduce",
                            "ag": "all-gather"}
    events = [{"ph": "X", "name": "ynn_fusion.34", "dur": 5}, {"ph": "X", "name": "dot.66", "dur": 7},
              {"ph": "X", "name": "dot.66", "dur": 1}, {"ph": "X", "name": "Rendezvous", "dur": 100},
              {"ph": "M", "name": "dot.66"}]
    assert time_by_opcode(events, hlo) == {"fusion:ynn_fusion": 5, "dot": 8}
