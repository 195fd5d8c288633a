"""The pipeline's host model (compiler/pipeline_step.py): the contention and the driver
costs ``shardprop calibrate`` measures (passes/cost.py ``CostModel.alone``,
``dispatch_s``, ``transfer_s``), how the host model uses them, and the MPMD lowering's
modeled step (the tick table simulated with release times: passes/pipeline/simulate.py)."""
from dataclasses import replace
from fractions import Fraction as Fr
from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardprop as sp
from shardprop.compiler.calibrate import host_cores
from shardprop.compiler.pipeline_step import (alone_cost, calibration_contention, devices_at_once, host_step,
                                              mpmd_host_step, shared_cores)
from shardprop.passes.cost import ComputeRates, CostModel
from shardprop.passes.pipeline import build_schedule, simulate
from shardprop.passes.pipeline.schedules import Action
from shardprop.passes.pipeline.simulate import shared_finish, shared_time
from shardprop.runtime.pipeline_mpmd import driver_order

# a CPU profile of 8 devices whose calibration measured one device alone 4x as fast as
# with all 8 busy: the host got 2 devices' work done at once
MEASURED = CostModel(flops_per_s=10e9, memory_bytes_per_s=5e9, contraction_bytes_per_s=2e9, device_count=8,
                     device_kind="cpu:cpu", name="measured", alone=ComputeRates(40e9, 15e9, 8e9),
                     dispatch_s=20e-6, transfer_s=50e-6)


def cpu_mesh(n):
    return NS(devices=np.array([NS(platform="cpu")] * n, dtype=object))


def test_profile_round_trips_the_measured_host_figures(tmp_path):
    MEASURED.save(tmp_path / "p.json")
    back = CostModel.load(tmp_path / "p.json")
    assert back == MEASURED and hash(back) == hash(MEASURED)
    assert back.alone == ComputeRates(40e9, 15e9, 8e9) and (back.dispatch_s, back.transfer_s) == (20e-6, 50e-6)
    # a profile written before these fields loads with none of them, and writes none
    old = CostModel.builtin("cpu")
    assert old.alone is None and old.dispatch_s is None and old.transfer_s is None
    assert "alone" not in old.to_dict() and "driver" not in old.to_dict()
    assert old.cores_alone == () and "cores_alone" not in old.to_dict()


def test_host_model_uses_the_measured_contention():
    assert calibration_contention(MEASURED) == 4.0
    assert devices_at_once(MEASURED) == 2.0
    fast = alone_cost(MEASURED)
    assert (fast.flops_per_s, fast.memory_bytes_per_s, fast.contraction_bytes_per_s) == (40e9, 15e9, 8e9)
    # 8 devices that get 2 devices' work done: 4 ranks of 2 devices share 1 rank-sized
    # core, 4 ranks of 1 device (of a 4-device mesh) share 1; 2 devices run side by side
    assert shared_cores(cpu_mesh(8), 4, MEASURED) == 1.0
    assert shared_cores(cpu_mesh(4), 4, MEASURED) == 2.0
    assert shared_cores(cpu_mesh(2), 2, MEASURED) is None
    # noise that puts the alone rate below the busy one is no contention, and no more
    # devices run at once than the profile has
    noisy = replace(MEASURED, alone=ComputeRates(5e9, 5e9, 2e9))
    assert calibration_contention(noisy) == 1.0 and devices_at_once(noisy) == 8.0
    # without the measurement: the old derivation (devices over this host's cores)
    derived = replace(MEASURED, alone=None)
    slow = max(1.0, 8 / host_cores())
    assert calibration_contention(derived) == slow and devices_at_once(derived) is None
    assert alone_cost(derived).flops_per_s == pytest.approx(10e9 * slow)
    assert shared_cores(cpu_mesh(8), 4, derived) == shared_cores(cpu_mesh(8), 4)


def _mlp_step(layers=4, width=8):
    opt = optax.sgd(0.1)

    def loss_fn(ws, x):
        h = x
        for i, w in enumerate(ws):
            h = jnp.tanh(h @ w)
            if i % 2 == 1 and i + 1 < layers:
                h = sp.stage_boundary(h)
        return jnp.mean(h ** 2)

    def step(ws, state, x):
        loss, g = jax.value_and_grad(loss_fn)(ws, x)
        up, state = opt.update(g, state, ws)
        return optax.apply_updates(ws, up), state, loss
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((width, width)).astype(np.float32) for _ in range(layers)]
    x = rng.standard_normal((8, width)).astype(np.float32)
    return step, (ws, opt.init(ws), x)


@pytest.fixture(scope="module")
def pipelined():
    """A 2-stage GPipe MLP step, m = 4, MPMD-lowered: its plan's program and MPMD driver."""
    step, args = _mlp_step()
    pstep = sp.parallelize(step, mesh=((2,), ("pp",)), pipeline=sp.Pipeline(microbatches=4, schedule="gpipe",
                                                                              lowering="mpmd"))
    return pstep.plan(*args).program, pstep.mpmd(*args)


def test_host_step_at_measured_rates_equals_the_contention_divided(pipelined):
    prog, _ = pipelined
    # alone rates 4x every busy rate: the same as dividing the busy prices by 4
    four = replace(MEASURED, alone=ComputeRates(40e9, 20e9, 8e9))
    assert host_step(prog, four)[0] == pytest.approx(host_step(prog, replace(four, alone=None), contention=4.0)[0])
    assert host_step(prog, four)[0] < host_step(prog, replace(four, alone=None), contention=1.0)[0]


def test_driver_order_is_what_the_mpmd_driver_issues(pipelined):
    prog, mp = pipelined
    order = driver_order(prog)
    assert [("run" if ins[0] == "once" else ins[0]) for ins in order] == [ins[0] for ins in mp.code]
    assert [ins[1] for ins in order if ins[0] == "move"] == [len(ins[1]) for ins in mp.code if ins[0] == "move"]
    assert sum(ins[0] == "run" for ins in order) == mp.actions_dispatched == len(prog.sim.tick_table)


def test_release_times_by_hand():
    """GPipe, 2 stages, 2 micro-batches, forward only, unit costs, each action released
    one dispatch after the one before (the driver's tick-table order)."""
    s = build_schedule("gpipe", 2, 2, forward_only=True)
    F = lambda i: Action("forward", i)
    release = {(0, F(0)): 1, (0, F(1)): 2, (1, F(0)): 3, (1, F(1)): 4}
    r = simulate(s, release=lambda d, a: release[(d, a)])
    assert r.span(0, F(0)) == (1, 2) and r.span(0, F(1)) == (2, 3)
    assert r.span(1, F(0)) == (3, 4) and r.span(1, F(1)) == (4, 5)
    assert r.makespan == 5 and simulate(s).makespan == 3
    # shared cores: released actions share them as before
    assert simulate(s, cores=1, release=lambda d, a: 0).makespan == 4 == simulate(s, cores=1).makespan


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zero_bubble"])
def test_release_times_only_delay(name):
    """Every action starts at or after its release, and a release of 0 changes nothing."""
    s = build_schedule(name, 3, 4)
    base = simulate(s)
    later = {(e.stage, e.action): Fr(n, 3) for n, e in enumerate(sorted(base.events, key=lambda e: e.start))}
    for cores in (None, 2):
        r = simulate(s, cores=cores, release=lambda d, a: later[(d, a)])
        assert all(e.start >= later[(e.stage, e.action)] for e in r.events)
        assert r.makespan >= simulate(s, cores=cores).makespan
        assert simulate(s, cores=cores, release=lambda d, a: 0).events == simulate(s, cores=cores).events


def test_shared_finish():
    assert shared_finish([(0, 1), (0, 2), (0, 3)], 2) == shared_time([1, 2, 3], 2) == Fr(7, 2)
    # one core: A alone for 1, then both at 1/2 until A is done at 3, then B alone
    assert shared_finish([(0, 2), (1, 2)], 1) == 4
    assert shared_finish([(0, 2), (1, 2)]) == 3 and shared_finish([(5, 0)], 1) == 5
    assert shared_finish([(0, 2.0), (1.0, 2.0)], 1.0) == pytest.approx(4.0)


@pytest.mark.parametrize("cores", [None, 1])
def test_mpmd_step_is_at_least_the_busiest_rank_and_its_dispatches(pipelined, cores):
    """Unit costs (F = 1, B = 2, once ops 1 per rank), exact: the MPMD step is at least each
    rank's work plus the driver's instructions up to its first action, and at least what
    the driver issues; with no driver cost it is the simulation alone (plus the once ops);
    with a driver far slower than the work it is the driver's time plus the last rank's
    once ops."""
    from shardprop.compiler.pipeline_step import mpmd_step
    prog, _ = pipelined
    unit, once = {"forward": 1, "backward": 2}, [1] * prog.p
    order = driver_order(prog)
    free, sim, issued = mpmd_step(prog, unit, 0, once, cores)
    assert issued == 0 and sim.events == simulate(prog.schedule, unit, cores=cores).events
    dispatch, transfer = Fr(1, 10), Fr(1, 4)
    step, sim, issued = mpmd_step(prog, unit, 0, once, cores, dispatch, transfer)
    cost = {"run": lambda ins: dispatch, "once": lambda ins: dispatch, "move": lambda ins: transfer * ins[1]}
    assert issued == sum(cost[ins[0]](ins) for ins in order)
    for d in range(prog.p):
        first = next(n for n, ins in enumerate(order) if ins[0] == "run" and ins[1] == d)
        assert step >= sum(cost[ins[0]](ins) for ins in order[:first + 1]) + sim.work[d] + once[d]
    assert step >= issued and step > free
    assert all(e.start >= dispatch for e in sim.events)
    step, sim, issued = mpmd_step(prog, unit, 0, once, cores, 100, 100)
    assert step == issued + once[-1]


def test_mpmd_host_step_prices_the_driver(pipelined):
    """The profile's driver costs make the modeled MPMD step longer, by no more than the
    driver's whole time."""
    prog, _ = pipelined
    none = replace(MEASURED, dispatch_s=None, transfer_s=None)
    base, _, zero = mpmd_host_step(prog, none)
    step, _, issued = mpmd_host_step(prog, MEASURED)
    assert zero == 0 and base < step <= base + issued


def test_capacity_curve_shares_as_measured():
    """A host that gets 1.5 devices' work done with 2 busy and 2 with 4 (the calibration's
    ``at_once``): 4 one-device ranks of a 4-device mesh share that curve, unit jobs
    finish as processor sharing at those rates, and a curve at the diagonal is no sharing."""
    from shardprop.passes.pipeline.simulate import Capacity
    curved = replace(MEASURED, at_once=((1, 1.0), (2, 1.5), (4, 2.0), (8, 2.0)))
    assert devices_at_once(curved) == 2.0 and devices_at_once(curved, 3) == 1.75
    cap = shared_cores(cpu_mesh(4), 4, curved)
    assert [cap(n) for n in (1, 2, 3, 4)] == [1.0, 1.5, 1.75, 2.0]
    # ranks of two devices each: 2 devices' work done by 4 devices busy is one rank's;
    # one rank alone, its two devices do 1.5 devices' work: 3/4 of the rank's alone rate
    assert shared_cores(cpu_mesh(8), 4, curved)(2) == 1.0 and shared_cores(cpu_mesh(8), 4, curved)(1) == 0.75
    # 4 unit jobs: all 4 at 2/4 until t = 2, when every job is done
    assert shared_time([1, 1, 1, 1], Capacity(((1, 1), (2, Fr(3, 2)), (4, 2)))) == 2
    # 2 jobs of 1 and 2: both at 3/4 until the first is done at 4/3, then the other's last 1 alone
    assert shared_time([1, 2], Capacity(((1, 1), (2, Fr(3, 2))))) == Fr(7, 3)
    assert shared_finish([(0, 1), (0, 2)], Capacity(((1, 1), (2, Fr(3, 2))))) == Fr(7, 3)
    assert shared_cores(cpu_mesh(4), 4, replace(MEASURED, at_once=((1, 1.0), (8, 8.0)))) is None
    s = build_schedule("gpipe", 4, 4)
    assert simulate(s, cores=Capacity(((1, 1), (4, 4)))).events == simulate(s).events
    assert simulate(s, cores=Capacity(((1, 1), (4, 2)))).makespan >= simulate(s, cores=2).makespan
    back = CostModel.from_dict(curved.to_dict())
    assert back.at_once == curved.at_once and back == curved
    with pytest.raises(sp.ShardingError, match="cores"):
        simulate(s, cores=Capacity(()))


def test_accumulating_actions_pay_the_add_into_the_accumulator(pipelined):
    """A backward's partial sums are added into its accumulator once per micro-batch by
    either lowering: its modeled time is its equations' plus that add (read the
    accumulator and the partial sum, write the accumulator); the last stage's forward sums
    its loss (a scalar) so."""
    from shardprop.compiler.pipeline_step import _eqn_time, _modeled_times
    prog, _ = pipelined
    times, _ = _modeled_times(prog, MEASURED)
    for k in range(prog.S):
        for kind in prog.kinds:
            pr = prog.progs[(kind, k)]
            own = sum(_eqn_time(prog.j.eqns[i], MEASURED) for i in pr["idxs"])
            floats = sum(int(np.prod(v.aval.shape)) for v in pr["accs"])
            assert floats > (1 if kind == "backward" else 0) or (kind, k) == ("forward", 0)
            assert times[k][kind] == pytest.approx(own + MEASURED.compute_time(floats, 12.0 * floats))


def test_core_share_rate_by_hand():
    """A host that got 1.4 one-core programs' work done with 2 or more running: the running
    actions' uses summed are the demand, the curve read at that many of its programs is
    what it delivers (never less than the largest use: an action alone runs at its own
    rate), and each runs at delivered / demand."""
    from shardprop.passes.pipeline.simulate import Capacity, CoreShare
    share = CoreShare(Capacity(((1, 1.0), (2, 1.4), (8, 1.4))), 1.0, lambda d, a: 1.0)
    assert share.rate([1.0, 1.0, 1.0, 1.0]) == pytest.approx(0.35)     # as counting 4 ranks: 1.4 / 4
    assert share.rate([1.0, 1.0]) == pytest.approx(0.7)
    assert share.rate([1.0]) == 1.0 and share.rate([2.0]) == 1.0       # alone: its own rate
    assert share.rate([1.75] * 4) == pytest.approx(1.75 / 7)           # 4 two-thread programs: 1 program's work
    assert share.rate([1.0, 0.5]) == pytest.approx(1.2 / 1.5)          # the curve at 1.5 programs: 1.2
    # programs of 2 cores measured the curve: two 1-core actions are one of them, side by side
    assert CoreShare(Capacity(((1, 1.0), (2, 1.4))), 2.0, lambda d, a: 1.0).rate([1.0, 1.0]) == 1.0


def test_core_share_in_the_simulator_and_once_ops():
    """Uses all equal to the curve's unit: the simulation is the rank-counting one; the
    once ops share by their own uses (``CoreShare.once``, per rank)."""
    from shardprop.passes.pipeline.simulate import Capacity, CoreShare
    cap = Capacity(((1, 1.0), (2, 1.5), (4, 2.0)))
    s = build_schedule("1f1b", 4, 8)
    counted = simulate(s, {"forward": 1.0, "backward": 2.0}, cores=cap)
    priced = simulate(s, {"forward": 1.0, "backward": 2.0}, cores=CoreShare(cap, 1.0, lambda d, a: 1.0))
    assert float(priced.makespan) == pytest.approx(float(counted.makespan))
    assert [(e.stage, e.action) for e in priced.events] == [(e.stage, e.action) for e in counted.events]
    # backwards that keep 2 cores busy alone: slower than counted, never faster than side by side
    heavy = simulate(s, {"forward": 1.0, "backward": 2.0},
                     cores=CoreShare(cap, 1.0, lambda d, a: 2.0 if a.is_backward else 1.0))
    assert heavy.makespan > priced.makespan
    # once ops: two jobs of 1 on a host of 2 cores (a plain number: 2 of the unit programs)
    assert shared_time([1, 1], CoreShare(2.0, 1.0, None, (1.0, 1.0))) == pytest.approx(1.0)
    # uses 2 and 1: 3 cores demanded, 2 delivered: both at 2/3
    assert shared_time([1, 1], CoreShare(2.0, 1.0, None, (2.0, 1.0))) == pytest.approx(1.5)
    # jobs that start apart: B (use 3) alone from 0 to 1, then with A (use 1): 4 demanded,
    # 3 delivered (B's own), both at 3/4 until B's last 1 is done at 7/3; A's last 1 alone
    assert shared_finish([(1, 2), (0, 2)], CoreShare(2.0, 1.0, None, (1.0, 3.0))) == pytest.approx(1 + 4 / 3 + 1)
    with pytest.raises(sp.ShardingError, match="cores"):
        simulate(s, cores=CoreShare(cap, 0.0, lambda d, a: 1.0))


def test_host_model_prices_each_actions_cores(pipelined):
    """The profile's measured cores (``cores_alone``): each action's cores are its ops'
    classes weighted by their time; a profile whose programs all keep one core busy, as
    its ``at_once`` matmul did, models the step as counting ranks did; old profiles
    (no ``cores_alone``) share as before; programs that keep 2 cores busy take longer."""
    from shardprop.compiler.pipeline_step import action_cores, core_share
    prog, _ = pipelined
    # exchanges priced at nothing, so that the stages overlap in this small model
    curved = replace(MEASURED, at_once=((1, 1.0), (2, 1.5), (4, 2.0), (8, 2.0)), latency_s=1e-12,
                     link_bytes_per_s=1e15)
    one = replace(curved, cores_alone=(("contraction", 1.0), ("memory", 1.0), ("at_once", 1.0)))
    assert core_share(cpu_mesh(2), 2, curved, prog) == shared_cores(cpu_mesh(2), 2, curved)
    assert action_cores(prog, curved) is None
    stages, once = action_cores(prog, one)
    assert all(u == pytest.approx(1.0) for st in stages for u in st.values()) and once == pytest.approx([1.0, 1.0])
    counted = mpmd_host_step(prog, one, shared_cores(cpu_mesh(2), 2, one))[0]
    assert mpmd_host_step(prog, one, core_share(cpu_mesh(2), 2, one, prog))[0] == pytest.approx(counted)
    assert host_step(prog, one, core_share(cpu_mesh(2), 2, one, prog))[0] == pytest.approx(
        host_step(prog, one, shared_cores(cpu_mesh(2), 2, one))[0])
    two = replace(one, cores_alone=(("contraction", 2.0), ("memory", 1.0), ("at_once", 1.0)))
    stages2, _ = action_cores(prog, two)
    assert all(1.0 < u <= 2.0 for st in stages2 for u in st.values())
    # (the SPMD model: this small MPMD step waits on its driver, whatever the cores)
    assert host_step(prog, two, core_share(cpu_mesh(2), 2, two, prog))[0] > host_step(
        prog, one, core_share(cpu_mesh(2), 2, one, prog))[0]
    back = CostModel.from_dict(two.to_dict())
    assert back == two and back.cores_alone == two.cores_alone and "cores_alone" not in curved.to_dict()


def test_a_programs_cores_are_its_ops_weighted_by_time(monkeypatch):
    """By hand: a matmul priced 3 s at 2 cores and an add priced 1 s at 1 core keep
    (3 * 2 + 1 * 1) / 4 cores busy; 4 s more of memory-bound work (an accumulation) at 1
    core, (6 + 1 + 4) / 8."""
    import shardprop.compiler.pipeline_step as ps
    monkeypatch.setattr(ps, "_eqn_time", lambda eqn, cost: 3.0 if eqn.primitive.name == "dot_general" else 1.0)
    eqns = [NS(primitive=NS(name="dot_general")), NS(primitive=NS(name="add"))]
    used = {"contraction": 2.0, "memory": 1.0}
    assert ps._ops_cores(eqns, None, used) == pytest.approx(7 / 4)
    assert ps._ops_cores(eqns, None, used, 4.0) == pytest.approx(11 / 8)
    assert ps._ops_cores([], None, used) == 1.0


def test_importing_the_bench_changes_nothing():
    """bench/pipeline.py, the host model's bench, forces its 8 CPU devices in ``main()``:
    importing it for its model (``make``) leaves the environment and jax's config alone."""
    import importlib.util
    import os
    from pathlib import Path
    env = dict(os.environ)
    devices = jax.config.jax_num_cpu_devices
    path = Path(__file__).resolve().parents[1] / "bench" / "pipeline.py"
    spec = importlib.util.spec_from_file_location("bench_pipeline_for_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(module.make) and callable(module.force_cpu_devices)
    assert dict(os.environ) == env and jax.config.jax_num_cpu_devices == devices


# ---------------------------------------------------------------- the plan's own figures
# (compiler/pipeline_host.py: plan(measure=True)) and the SPMD lowering's lockstep ticks

def test_lockstep_ticks_by_hand():
    """Two ticks: ranks running works 1 and 2, then 1 alone. Side by side the first tick
    ends with its slowest action (2), then 1: 3. On one shared core the first tick's two
    actions share it (both at 1/2 until t = 2, the rest of the 2 alone: 3), then 1: 4.
    Each tick's exchanges add their latency."""
    from shardprop.passes.pipeline.simulate import lockstep_time
    ticks = [[(1, 1), (2, 1)], [(1, 1)]]
    assert lockstep_time(ticks) == 3
    assert lockstep_time(ticks, cores=1) == 4
    assert lockstep_time(ticks, cores=1, latency=[Fr(1, 2), 0]) == Fr(9, 2)
    with pytest.raises(sp.ShardingError, match="2 ticks"):
        lockstep_time(ticks, latency=[1])


@pytest.fixture(scope="module")
def measured_1f1b():
    """A 2-stage 1F1B MLP step, m = 4, SPMD-lowered, planned with measure=True."""
    step, args = _mlp_step()
    pstep = sp.parallelize(step, mesh=((2,), ("pp",)), pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
    return pstep, args, pstep.plan(*args, measure=True)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_spmd_step_runs_the_unit_tick_table_in_lockstep(name):
    """At equal action times the lockstep loop is the unit-cost tick table (one action
    time a tick). With backwards twice as long, GPipe's ticks each hold one kind, so
    lockstep ends where the event-by-event simulation does; 1F1B's steady ticks hold a
    forward beside a backward, and the forward's rank waits: lockstep is longer."""
    from shardprop.compiler.pipeline_step import UNIT, spmd_step
    s = build_schedule(name, 2, 4)
    prog = NS(sim=simulate(s, UNIT), schedule=s, S=2, p=2, kinds=["forward", "backward"], tables=None)
    once = [0, 0]
    equal = {kind: [Fr(1)] * 2 for kind in prog.kinds}
    assert spmd_step(prog, equal, 0, once)[0] == prog.sim.makespan
    longer = {"forward": [Fr(1)] * 2, "backward": [Fr(2)] * 2}
    events = simulate(s, longer).makespan
    if name == "gpipe":
        assert spmd_step(prog, longer, 0, once)[0] == events
    else:
        assert spmd_step(prog, longer, 0, once)[0] > events


def test_capacity_fit_reads_back_the_sharing_it_was_made_from():
    """Runs timed as the simulation would share them on a known curve give that curve
    back (uneven ranks' work included); a run faster than its longest rank alone is no
    more than side by side, and a stall is held at LEAST_CAPACITY."""
    from shardprop.compiler.pipeline_host import LEAST_CAPACITY, fit_capacity
    from shardprop.passes.pipeline.simulate import Capacity
    truth = Capacity(((1, 1.0), (2, 1.3), (3, 1.2), (4, 0.9)))
    works = [0.010, 0.012, 0.011, 0.015]
    runs = [(n, works[:n], float(shared_time(works[:n], truth))) for n in (2, 3, 4)]
    fitted = fit_capacity(runs)
    assert [n for n, _ in fitted] == [1, 2, 3, 4]
    assert [c for _, c in fitted] == pytest.approx([c for _, c in truth.points], abs=1e-4)
    assert fit_capacity([(2, [1.0, 1.0], 0.5)]) == ((1, 1.0), (2, 2.0))
    assert fit_capacity([(2, [1.0, 1.0], 1e6)]) == ((1, 1.0), (2, LEAST_CAPACITY))


def test_host_figures_flow_into_the_model(pipelined):
    """``measured_host_step`` simulates the figures it is given: the actions' times alone
    (twice as long, a longer step), the ranks' work at once (less work done at once, a
    longer step; side by side, the side-by-side simulation) and the driver's costs."""
    from shardprop.compiler.pipeline_host import HostFigures
    from shardprop.compiler.pipeline_step import measured_host_step
    from shardprop.compiler.pipeline_step import mpmd_step
    prog, _ = pipelined
    alone = tuple(((kind, k), 1e-3 * (2 if kind != "forward" else 1)) for k in range(prog.S) for kind in prog.kinds)
    figs = HostFigures(alone, (1e-4,) * prog.p, ((1, 1.0), (2, 2.0)), (), 0.0, 0.0, 1)
    slower = replace(figs, alone=tuple((key, 2 * t) for key, t in alone))
    shared = replace(figs, at_once=((1, 1.0), (2, 1.0)))
    driven = replace(figs, dispatch_s=1e-4, transfer_s=1e-4)
    for lowering in ("spmd", "mpmd"):
        base = measured_host_step(prog, figs, lowering, MEASURED)[0]
        assert measured_host_step(prog, slower, lowering, MEASURED)[0] > 1.5 * base
        assert measured_host_step(prog, shared, lowering, MEASURED)[0] > base
    base = measured_host_step(prog, figs, "mpmd", MEASURED)[0]
    assert measured_host_step(prog, driven, "mpmd", MEASURED)[0] > base
    # the SPMD program's idle loop (its once ops, exchanges and packing, measured) is added
    # to the actions in lockstep, in place of the once ops and modeled exchanges
    from shardprop.compiler.pipeline_step import spmd_step
    lockstep = spmd_step(prog, figs.durations(prog), 0.0, [0.0] * prog.p, figs.capacity())[0]
    idle = replace(figs, idle_loop=5e-3)
    assert measured_host_step(prog, idle, "spmd", MEASURED)[0] == pytest.approx(lockstep + 5e-3)
    # a rank whose actions took 1.5x their time alone in the loop (its loop with only its
    # actions, less the idle loop) runs them 1.5x as long; a faster reading is taken as 1
    work = [prog.m * sum(t for (kind, k), t in alone if prog.rank_of(k) == d) for d in range(prog.p)]
    slow = replace(idle, in_loop=(5e-3 + 1.5 * work[0], 5e-3 + 0.5 * work[1]))
    assert slow.in_loop_factor(prog) == pytest.approx([1.5, 1.0])
    assert slow.loop_durations(prog)["forward"] == pytest.approx([1.5e-3, 1e-3])
    assert measured_host_step(prog, slow, "spmd", MEASURED)[0] > measured_host_step(prog, idle, "spmd", MEASURED)[0]
    copies = [8 * 8 * 2 / MEASURED.alone.memory_bytes_per_s]      # a micro-batch's 2 x 8 floats, copied
    side_by_side = mpmd_step(prog, figs.durations(prog), copies, list(figs.once), None)[0]
    assert base == pytest.approx(side_by_side)


@pytest.mark.slow
def test_plan_measure_times_the_stage_programs(measured_1f1b):
    """``plan(measure=True)`` times every (kind, stage) program and each rank's once ops,
    fits the ranks' work at once, and its host_step_time is the model on those figures."""
    from shardprop.compiler.pipeline_host import LEAST_CAPACITY, HostFigures
    from shardprop.compiler.pipeline_step import measured_host_step
    pstep, args, plan = measured_1f1b
    figs, prog = plan.pipeline.host_figures, plan.program
    assert isinstance(figs, HostFigures)
    assert sorted(dict(figs.alone)) == sorted((kind, k) for k in range(prog.S) for kind in prog.kinds)
    assert all(t > 0 for _, t in figs.alone) and len(figs.once) == prog.p and all(t > 0 for t in figs.once)
    assert [n for n, _ in figs.at_once] == [1, 2] and LEAST_CAPACITY <= figs.at_once[1][1] <= 2
    assert [n for n, _, _ in figs.runs] == [2] and len(figs.runs[0][1]) == 2
    assert figs.dispatch_s > 0 and figs.transfer_s > 0 and figs.idle_loop > 0
    assert len(figs.in_loop) == prog.p and all(t > 0 for t in figs.in_loop)
    assert all(f >= 1.0 for f in figs.in_loop_factor(prog))
    assert plan.pipeline.host_step_time == measured_host_step(prog, figs, "spmd", pstep.cost)[0]
    assert "ranks at once" in figs.text()
    # without measure=True the plan keeps the profile's model
    assert pstep.plan(*args).pipeline.host_figures is None


def test_plan_measure_refuses_ranks_of_several_devices():
    step, args = _mlp_step()
    pstep = sp.parallelize(step, mesh=((2, 2), ("pp", "dp")), pipeline=sp.Pipeline(microbatches=2))
    with pytest.raises(sp.ShardingError, match="one device.*Fix: measure the step on a mesh of the 'pp' axis"):
        pstep.plan(*args, measure=True)


@pytest.mark.slow
def test_plan_measure_times_the_mpmd_programs_and_the_spmd_branches(measured_1f1b):
    """For the MPMD lowering the plan times its stage programs (no idle loop: nothing
    runs beside them but the driver); for the SPMD lowering the tick loop's branches, each
    adding its piece into the flat accumulator as the loop does."""
    from shardprop.compiler.pipeline_host import BranchProgram, branch_programs, rank_devices
    from shardprop.compiler.pipeline_step import measured_host_step
    step, args = _mlp_step()
    pstep = sp.parallelize(step, mesh=((2,), ("pp",)), pipeline=sp.Pipeline(microbatches=4, schedule="1f1b",
                                                                              lowering="mpmd"))
    plan = pstep.plan(*args, measure=True)
    figs = plan.pipeline.host_figures
    assert figs.idle_loop is None
    assert plan.pipeline.host_step_time == measured_host_step(plan.program, figs, "mpmd", pstep.cost)[0]
    spmd, args, spmd_plan = measured_1f1b
    prog = spmd_plan.program
    c, leaves, _ = spmd._compile(args)
    _, _, rep, batch = spmd._inputs(c, leaves)
    programs = branch_programs(prog, rank_devices(prog), rep, batch)
    for kind in prog.kinds:
        for k in range(prog.S):
            pr = programs[(kind, k)]
            assert isinstance(pr, BranchProgram) and pr.times == prog.m
            pr()
            acc, resid_row, out_row, send_f, send_b = pr.last
            assert acc.shape == (prog.ACC,) and send_f.shape == (prog.A,) and send_b.shape == (prog.G,)
            assert list(acc.devices()) == [rank_devices(prog)[prog.rank_of(k)]]
