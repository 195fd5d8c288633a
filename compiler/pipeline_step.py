"""``sp.parallelize(step, mesh=..., pipeline=sp.Pipeline(...))``: the pipelined step.

:class:`PipelineFunction` traces the whole step (global batch and one micro-batch),
assigns its ops to stages (``compiler/pipeline_assign.py``), builds the schedule and its
unit-cost tick table (``passes/pipeline``) and lowers it to one SPMD program
(``runtime/pipeline_lower.py``). ``pstep.plan(*args)`` returns a :class:`PipelinePlan`
whose ``.pipeline`` has the stages, the tick table and the modeled bubble.

State: the step's state outputs (what a rank's ``once`` ops compute: the new parameters
and optimizer state) come back as ``PackedLeaf`` objects in the user's pytree; each one
indexes a ``(p, size)`` array split over the pipeline axis, so a stage's parameters stay
on its rank between steps. Pass them back to the step as they are (read in place);
``sp.to_numpy(leaf)`` / ``np.asarray(leaf)`` or :func:`unpack` give values.

Other mesh axes: ``"dp"`` alone splits each micro-batch over its devices. Tensor-parallel
axes (or ZeRO-1, ``shard_optimizer_state``) have the step planned once on the axes beside
the pipeline's by the non-pipeline passes (``compiler/pipeline_submesh.py``); the
analysis and the lowering then work on that per-rank program, and the state is packed
per (pipeline rank, sub-mesh rank) as local blocks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ..ir.errors import ShardingError
from ..passes.cost import resolve_cost_model
from ..passes.pipeline import build_schedule, simulate
from ..runtime.mesh import resolve_mesh
from ..runtime.pipeline_lower import PackedLeaf, PipelineProgram, np_to_f32, pack_blocks
from ..passes.pipeline.cuts import CUT_WINDOWS, STAGE_WINDOWS, cut_windows
from ..passes.pipeline.search import NoPipelineFits
from .pipeline_assign import (analyse, auto_stages, inline_calls,
                              layer_bounds, layer_costs, merge_layers)
from .stages import Pipeline, check_pipeline

# cuts priced within this fraction of the best are a tie, broken toward balanced compute
TIE_TOLERANCE = 0.01
# mode="auto" under memory_limit: builds with the sub-mesh search held to what the pipeline
# leaves of the limit, each counting what the last build's pipeline keeps (_fit_submesh)
FIT_ROUNDS = 3
UNIT = {"forward": 1, "backward": 1, "backward_input": 1, "backward_weight": 1}


def unpack(tree):
    """A pytree with every ``PackedLeaf`` (and jax array) as a numpy array."""
    return jax.tree.map(lambda x: np.asarray(x), tree)


@dataclass
class StageInfo:
    """One model stage: ``rank`` on the pipeline axis, ``chunk`` (interleaved), the
    devices that run it, its ops (primitive names, program order) and state inputs."""
    index: int
    rank: int
    chunk: int
    devices: tuple
    forward_ops: list
    backward_ops: list
    once_ops: list
    params: list = field(default_factory=list)   # (argument path, shape) of the state it owns

    @property
    def ops(self) -> list:
        return self.forward_ops + self.backward_ops + self.once_ops


@dataclass
class PipelineInfo:
    stages: list
    schedule: dict          # (tick, rank) -> Action, the lowering's unit-cost tick table
    bubble: float           # modeled idle fraction (simulator on the cost model's stage times)
    ticks: int
    microbatches: int
    schedule_name: str
    sim: object             # the lowering's SimResult
    model_sim: object       # the modeled SimResult (bubble)
    slots: int              # activation slots per rank
    step_time: float = 0.0  # modeled seconds of the step (the simulator's makespan)
    unit_bubble: float = 0.0   # the idle fraction at unit costs (F = 1, B = 2): (p-1)/(m+p-1) for gpipe/1f1b
    search: Optional[list] = None   # "auto": a SearchRow per candidate, those that fit fastest first, then the rejected
    memory: int = 0         # modeled bytes per device (state, accumulator, activation slots)
    stage_times: list = field(default_factory=list)   # per model stage: {kind: modeled seconds}
    # modeled seconds of the step as it runs on these devices: stage work at one device's
    # rate alone, ranks sharing the host's cores where forced CPU devices outnumber them
    # (host_step or mpmd_host_step, sharing by core_share), plus the once ops; with
    # plan(measure=True), the same simulation on the plan's own measured figures
    # (measured_host_step); step_time is the side-by-side model the search uses
    host_step_time: float = 0.0
    # plan(measure=True): the stage programs' own figures on this host
    # (compiler/pipeline_host.py HostFigures), which host_step_time was then modeled on
    host_figures: Optional[object] = None
    # mode="auto" beside the pipeline (a searched sub-mesh), bytes per device: the search's
    # modeled peak of one micro-batch's step (passes/auto's count, every stage's state in
    # it), less the state a device does not store (_state_elsewhere), plus what the
    # pipeline keeps beyond one micro-batch (_beyond_one): device_peak, held to
    # memory_limit; submesh_budget: what the search was held to (None: not limited)
    submesh_peak: float = 0.0
    state_elsewhere: float = 0.0
    beyond_one_microbatch: float = 0.0
    device_peak: float = 0.0
    submesh_budget: Optional[int] = None

    def render(self) -> str:
        return self.sim.render()

    def text(self) -> str:
        lines = [f"pipeline: {self.schedule_name}, {len(self.stages)} model stages, {self.microbatches} "
                 f"micro-batches, {self.ticks} ticks, modeled bubble {self.bubble:.3f}, modeled step "
                 f"{self.step_time * 1e6:.1f} us, {self.slots} slots per rank"]
        for s in self.stages:
            lines.append(f"stage {s.index} (rank {s.rank}, chunk {s.chunk}, devices {list(s.devices)}): "
                         f"{len(s.forward_ops)} forward ops, {len(s.backward_ops)} backward ops, "
                         f"{len(s.once_ops)} once ops; state {s.params}")
        if self.device_peak:
            lines.append(f"modeled peak per device {self.device_peak:,.0f} bytes: the sub-mesh plan's "
                         f"{self.submesh_peak:,.0f} for one micro-batch's step"
                         + (f" (held to {self.submesh_budget:,})" if self.submesh_budget is not None else "")
                         + f", less {self.state_elsewhere:,.0f} of other stages' state, plus "
                         f"{self.beyond_one_microbatch:,.0f} the pipeline keeps beyond one micro-batch")
        lines.append(self.render())
        return "\n".join(lines)

    def rank_text(self, rank: int) -> str:
        """One rank's programs: its model stages' ops per action kind, its exchanges and
        its row of the tick table."""
        mine = [s for s in self.stages if s.rank == rank]
        lines = [f"rank {rank}: model stages {[s.index for s in mine]} on devices {list(mine[0].devices)}"]
        for s in mine:
            for kind, ops in (("forward", s.forward_ops), ("backward", s.backward_ops), ("once", s.once_ops)):
                lines.append(f"  stage {s.index} {kind} ({len(ops)} ops): {' '.join(ops)}")
            if s.index + 1 < len(self.stages):
                lines.append(f"  stage {s.index} sends its activations to rank {self.stages[s.index + 1].rank} "
                             "(collective-permute over the pipeline axis)")
            if s.index > 0 and self.schedule_has_backward():
                lines.append(f"  stage {s.index} sends its input cotangents to rank {self.stages[s.index - 1].rank}")
            lines.append(f"  state owned: {s.params}")
        row = [str(self.schedule[(t, rank)]) if (t, rank) in self.schedule else "." for t in range(self.ticks)]
        lines.append("  ticks: " + " ".join(row))
        return "\n".join(lines)

    def to_data(self) -> dict:
        """The plan as JSON-ready data: what its report page draws."""
        ranks = sorted({s.rank for s in self.stages})
        timeline = [[None if (t, d) not in self.schedule else
                     {"kind": self.schedule[(t, d)].kind, "microbatch": self.schedule[(t, d)].microbatch,
                      "chunk": self.schedule[(t, d)].chunk, "label": str(self.schedule[(t, d)])}
                     for t in range(self.ticks)] for d in ranks]
        stages = [{"index": s.index, "rank": s.rank, "chunk": s.chunk, "devices": list(s.devices),
                   "forward_ops": s.forward_ops, "backward_ops": s.backward_ops, "once_ops": s.once_ops,
                   "params": [[path, list(shape)] for path, shape in s.params]} for s in self.stages]
        return {"kind": "pipeline", "schedule": self.schedule_name, "microbatches": self.microbatches,
                "ticks": self.ticks, "ranks": ranks, "bubble": self.bubble, "unit_bubble": self.unit_bubble,
                "step_time": self.step_time, "slots": self.slots, "memory": self.memory, "stages": stages,
                "timeline": timeline, "rank_texts": [self.rank_text(d) for d in ranks],
                "search": [list(r) for r in self.search if math.isfinite(r[0])] if self.search else None,
                # the candidates the search rejected, each with its reason
                "search_rejected": [[r[1], r[2], getattr(r, "reason", "")] for r in self.search
                                    if not math.isfinite(r[0])] if self.search else None}

    def to_html(self, path: Optional[str] = None) -> str:
        """The report page (compiler/report.py ``render_pipeline_html``): the schedule as a
        timeline (ranks x ticks, each action with its micro-batch, bubbles blank), the
        stages (rank, devices, ops, state) and each rank's program. Written to ``path``
        when given; returns the HTML."""
        from .report import render_pipeline_html
        page = render_pipeline_html(self.to_data())
        if path:
            with open(path, "w", encoding="utf-8") as f:
                f.write(page)
        return page

    def schedule_has_backward(self) -> bool:
        return any(a.kind != "forward" for a in self.schedule.values())


@dataclass
class PipelinePlan:
    pipeline: PipelineInfo
    program: object
    hlo: Optional[str] = None

    def text(self) -> str:
        return self.pipeline.text()

    def to_html(self, path=None) -> str:
        """Write the plan's report page (see ``PipelineInfo.to_html``) to ``path`` and
        return the path, as ``Plan.to_html`` does; without a path, return the page."""
        page = self.pipeline.to_html(str(path) if path is not None else None)
        return page if path is None else str(path)


def _eqn_time(eqn, cost) -> float:
    """The roofline time of one equation (passes/cost.py's ``compute_time``): dot_general
    and convolutions count 2 flops per multiply-add, everything else one per output."""
    out = sum(int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape"))
    touched = sum(int(np.prod(getattr(v.aval, "shape", ()))) * getattr(getattr(v.aval, "dtype", None), "itemsize", 4)
                  for v in list(eqn.invars) + list(eqn.outvars) if hasattr(v, "aval"))
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        k = int(np.prod([eqn.invars[0].aval.shape[d] for d in lc])) if lc else 1
        return cost.compute_time(2.0 * out * k, touched, contraction=True)
    if name == "conv_general_dilated":
        w = eqn.invars[1].aval.shape
        return cost.compute_time(2.0 * out * int(np.prod(w)) / max(1, w[0]), touched, contraction=True)
    return cost.compute_time(float(out), touched)


def calibration_contention(cost) -> float:
    """How many times slower ``cost``'s compute rates are than one device running alone:
    ``shardprop calibrate`` times compute with every device of the profile busy at once.
    Where the profile measured one device alone too (``cost.alone``), the ratio of the two
    matmul rates. Otherwise derived: where its ``device_count`` forced CPU devices
    outnumbered the host's cores each ran at cores / devices of a core. The host's core
    count is the profile's ``host_cores`` where it records one; a CPU profile that does not
    is taken to be calibrated on this machine (its cores, ``os.sched_getaffinity``), as the
    built-in ``"cpu"`` one was. 1 for any other profile (its devices each had their own
    hardware)."""
    alone = getattr(cost, "alone", None)
    if alone is not None and getattr(cost, "flops_per_s", 0):
        return max(1.0, alone.flops_per_s / cost.flops_per_s)
    devices = getattr(cost, "device_count", None)
    cores = getattr(cost, "host_cores", None)
    if cores is None and str(getattr(cost, "device_kind", "")).startswith("cpu"):
        from .calibrate import host_cores
        cores = host_cores()
    if not devices or not cores:
        return 1.0
    return max(1.0, devices / cores)


def alone_cost(cost):
    """``cost`` at one device's rates alone: the profile's measured ``alone`` rates, or its
    rates times ``calibration_contention`` where it did not measure them."""
    from dataclasses import replace
    alone = getattr(cost, "alone", None)
    if alone is not None:
        return replace(cost, flops_per_s=alone.flops_per_s, memory_bytes_per_s=alone.memory_bytes_per_s,
                       contraction_bytes_per_s=alone.contraction_bytes_per_s or cost.contraction_bytes_per_s)
    slow = calibration_contention(cost)
    if slow == 1.0:
        return cost
    streaming = cost.contraction_bytes_per_s
    return replace(cost, flops_per_s=cost.flops_per_s * slow, memory_bytes_per_s=cost.memory_bytes_per_s * slow,
                   contraction_bytes_per_s=None if streaming is None else streaming * slow)


def devices_at_once(cost, busy=None):
    """How many devices' work alone a host gets done with ``busy`` (default: all) of
    ``cost``'s devices running at once, as its calibration measured it: its ``at_once``
    curve where it has one (linear between the counts measured), else from the rates of
    one device alone and of all busy (``device_count`` times their ratio, as a fixed
    number of cores: at most ``busy``). At least 1. None where the profile measured
    neither."""
    from ..passes.pipeline.simulate import Capacity
    devices = getattr(cost, "device_count", None)
    busy = devices if busy is None else busy
    if getattr(cost, "at_once", ()):
        return max(1.0, float(Capacity(tuple(cost.at_once))(busy)))
    alone = getattr(cost, "alone", None)
    if alone is None or not devices:
        return None
    return min(float(busy), max(1.0, devices * cost.flops_per_s / alone.flops_per_s))


def shared_cores(mesh, p: int, cost=None):
    """Rank-sized cores the ``p`` pipeline ranks of ``mesh`` share, or None when they run
    side by side: forced CPU devices are threads of this process, so where they outnumber
    what the host runs at once the ranks' actions take turns (a rank's action keeps its
    ``devices / p`` devices busy, so a device's worth of the host counts ``p / devices`` of
    a rank). What the host runs at once: the profile's measured ``at_once`` curve (a
    ``Capacity``: n ranks running get ``devices_at_once(cost, n * devices / p)`` devices'
    work done), or the single figure ``devices_at_once(cost)``, or the host's cores."""
    from fractions import Fraction

    from ..passes.pipeline.simulate import Capacity
    devices = _cpu_devices(mesh)
    if devices is None:
        return None
    per_rank = len(devices) / p
    if cost is not None and getattr(cost, "at_once", ()):
        capacity = Capacity(tuple((n, devices_at_once(cost, n * per_rank) / per_rank) for n in range(1, p + 1)))
        return capacity if capacity.shares(p) else None
    measured = devices_at_once(cost) if cost is not None else None
    if measured is not None:
        return None if len(devices) <= measured else measured * p / len(devices)
    from .calibrate import host_cores
    cores = host_cores()
    if len(devices) <= cores:
        return None
    return Fraction(cores * p, len(devices))


CONTRACTIONS = ("dot_general", "conv_general_dilated")


def cores_alone(cost) -> dict:
    """The cores one device's programs kept busy alone when ``shardprop calibrate`` timed
    them (``CostModel.cores_alone``: ``"contraction"``, ``"memory"`` and ``"at_once"``, the
    matmul of its ``at_once`` curve); empty for a profile that did not measure them."""
    return dict(getattr(cost, "cores_alone", None) or ())


def _ops_cores(eqns, cost, used: dict, extra_memory_time: float = 0.0) -> float:
    """The cores a program of ``eqns`` keeps busy alone: each equation's class (a
    contraction, or a memory-bound op) at its measured cores ``used``, weighted by the
    equation's time at ``cost``'s rates; ``extra_memory_time`` more seconds of memory-bound
    work (the accumulation add). 1 for a program that takes no time."""
    weighted = total = 0.0
    for eqn in eqns:
        t = _eqn_time(eqn, cost)
        weighted += t * used["contraction" if eqn.primitive.name in CONTRACTIONS else "memory"]
        total += t
    weighted += extra_memory_time * used["memory"]
    total += extra_memory_time
    return weighted / total if total > 0 else 1.0


def action_cores(prog, cost) -> tuple:
    """(per model stage ``{kind: cores}``, per rank its once ops' cores): the cores each
    action keeps busy alone on one device (``_ops_cores`` over its program at ``cost``'s
    rates alone), from the profile's ``cores_alone``. None where it has none."""
    used = cores_alone(cost)
    if not {"contraction", "memory"} <= set(used):
        return None
    priced = alone_cost(cost)
    j = prog.j
    stages = [{kind: _ops_cores([j.eqns[i] for i in prog.progs[(kind, k)]["idxs"]], priced, used,
                                _accumulation_time(prog.progs[(kind, k)]["accs"], priced))
               for kind in prog.kinds} for k in range(prog.S)]
    once = [_ops_cores([j.eqns[i] for k in range(prog.S) if prog.rank_of(k) == d for i in prog.once[k]["idxs"]],
                       priced, used) for d in range(prog.p)]
    return stages, once


def _cpu_devices(mesh):
    """The CPU devices of ``mesh`` (forced CPU devices share this host's cores), or None:
    an abstract mesh (no host to share) or another platform's devices."""
    try:
        devices = list(np.asarray(mesh.devices).reshape(-1))
    except (AttributeError, TypeError, ValueError):
        return None
    return devices if devices and getattr(devices[0], "platform", "") == "cpu" else None


def core_share(mesh, p: int, cost, prog):
    """What the ``p`` ranks of ``prog`` share on this host: a ``CoreShare`` where the
    profile measured the cores its programs keep busy alone and its ``at_once`` curve
    (each action demanding its ``action_cores`` times the devices of a rank; the host
    delivering what the curve measured, converted to cores by the cores its program kept
    busy alone), else ``shared_cores`` (ranks counted, not their cores)."""
    from ..passes.pipeline.simulate import Capacity, CoreShare
    used = cores_alone(cost)
    per_stage = action_cores(prog, cost) if cost is not None else None
    if per_stage is None or not getattr(cost, "at_once", ()) or "at_once" not in used:
        return shared_cores(mesh, p, cost)
    devices = _cpu_devices(mesh)
    if devices is None:
        return None
    per_rank = len(devices) / p
    stages, once = per_stage
    schedule = prog.schedule
    return CoreShare(Capacity(tuple(cost.at_once)), used["at_once"],
                     lambda d, a: per_rank * stages[schedule.model_stage(d, a.chunk)][a.kind],
                     tuple(per_rank * u for u in once))


def _modeled_times(prog, cost=None, contention: float = 1.0):
    """Per model stage, the modeled seconds of each action kind on one micro-batch (the
    roofline of ``cost``, default the default cost model, over its programs' equations),
    and per boundary the exchange time of the activations (alpha-beta over its default
    link). An action that accumulates (a backward's weight gradients) also pays the
    lowering's add of its partial sums into the accumulator (``_accumulation_time``).
    ``contention``: how much slower the profile's compute rates are than a device running
    alone (``calibration_contention``); the compute times are divided by it."""
    if cost is None:
        from ..passes.cost import DEFAULT_COST as cost
    j = prog.j
    times = []
    for k in range(prog.S):
        times.append({kind: max(1e-9, (sum(_eqn_time(j.eqns[i], cost) for i in prog.progs[(kind, k)]["idxs"])
                                       + _accumulation_time(prog.progs[(kind, k)]["accs"], cost)) / contention)
                      for kind in prog.kinds})
    latency = [cost.latency_s + 4 * _boundary_floats(prog, k) / cost.link_bytes_per_s for k in range(prog.S - 1)]
    return times, latency


def _accumulation_time(accs, cost) -> float:
    """Adding an action's partial sums ``accs`` into its accumulator, once per micro-batch
    (both lowerings do; the traced program does not): one elementwise add per value, the
    accumulator and the partial sum read and the accumulator written."""
    n = sum(int(np.prod(getattr(v.aval, "shape", ()))) for v in accs)
    nbytes = sum(int(np.prod(getattr(v.aval, "shape", ()))) * np.dtype(v.aval.dtype).itemsize for v in accs)
    return cost.compute_time(float(n), 3.0 * nbytes) if n else 0.0


def _boundary_floats(prog, k: int) -> int:
    """Floats an action of model stage ``k`` sends to ``k + 1`` (its packed activations)."""
    from ..runtime.pipeline_lower import Packing
    return Packing(prog.fwd_out[k]).size


def _once_times(prog, cost, contention: float = 1.0) -> list:
    """Per rank, the modeled seconds of its stages' once ops (the optimizer)."""
    return [sum(_eqn_time(prog.j.eqns[i], cost) for k in range(prog.S) if prog.rank_of(k) == d
                for i in prog.once[k]["idxs"]) / contention for d in range(prog.p)]


def _priced(cost, contention):
    """(the cost model to price with, the contention to divide its times by): one
    device's rates alone (``alone_cost``), or ``cost`` over an explicit ``contention``."""
    if cost is None:
        from ..passes.cost import DEFAULT_COST as cost
    return (alone_cost(cost), 1.0) if contention is None else (cost, contention)


def stage_durations(prog, times) -> dict:
    """Per-stage action times (``[{kind: seconds}, ...]``, as ``_modeled_times`` gives
    them) as ``simulate`` takes durations: ``{kind: [seconds per model stage]}``."""
    return {kind: [times[k][kind] for k in range(prog.S)] for kind in prog.kinds}


def spmd_step(prog, durations, latency, once, cores=None):
    """The SPMD lowering's step with these stage ``durations`` and exchange ``latency`` (as
    ``simulate`` takes them) and per rank its ``once`` ops' time: its tick loop run in
    lockstep (``lockstep_time``): at each tick of the unit-cost tick table the busy ranks
    run their actions sharing ``cores`` (None: side by side), the tick ends when the last
    has ended (the exchanges after it are a rendezvous of every rank), then each exchange
    the tick runs (forward, backward: ``prog.tables``' flags) costs the largest boundary's
    latency (every rank sends the largest stage's packed size); then the once ops sharing
    the cores again. Returns ``(seconds, the unit-cost SimResult the lowering runs, the
    once phase's seconds)``."""
    from ..passes.pipeline.simulate import CoreShare, lockstep_time, shared_time
    T = int(prog.sim.makespan)
    use = cores.action_use if isinstance(cores, CoreShare) else (lambda d, a: 1)
    ticks = [[] for _ in range(T)]
    for (t, d), a in sorted(prog.sim.tick_table.items()):
        k = prog.schedule.model_stage(d, a.chunk)
        ticks[t].append((durations[a.kind][k], use(d, a)))
    per = float(max(latency)) if isinstance(latency, (list, tuple)) and latency else float(latency or 0)
    tables = getattr(prog, "tables", None)
    exchanges = ([int(tables["any_f"][t][0]) + int(tables["any_b"][t][0]) for t in range(T)]
                 if tables is not None and prog.p > 1 else [0] * T)
    loop = lockstep_time(ticks, cores, [per * n for n in exchanges])
    tail = float(shared_time(once, cores))
    return float(loop) + tail, prog.sim, tail


def host_step(prog, cost=None, cores=None, contention=None):
    """The modeled step of the SPMD lowering on a host whose ranks share ``cores``
    (``shared_cores``; None: side by side): each stage's actions at one device's rate
    alone (``alone_cost``; or the profile's compute times over ``contention``), run by
    ``spmd_step``. Returns ``(seconds, the SimResult, the once phase's seconds)``."""
    priced, slow = _priced(cost, contention)
    times, latency = _modeled_times(prog, priced, contention=slow)
    return spmd_step(prog, stage_durations(prog, times), latency, _once_times(prog, priced, slow), cores)


def mpmd_host_step(prog, cost=None, cores=None, contention=None):
    """The modeled step of the MPMD lowering (``runtime/pipeline_mpmd.py``) on a host whose
    ranks share ``cores``: the stages priced as ``host_step`` prices them, an exchange a
    copy of the activations at the memory rate (a ``jax.device_put``), the profile's
    ``dispatch_s`` per program and ``transfer_s`` per value moved as the driver's costs (0
    where it did not measure them), run by ``mpmd_step``. Returns ``(seconds, the
    SimResult, the driver's seconds)``."""
    priced, slow = _priced(cost, contention)
    times, _ = _modeled_times(prog, priced, contention=slow)
    durations = stage_durations(prog, times)
    copies = [8 * _boundary_floats(prog, k) / priced.memory_bytes_per_s / slow for k in range(prog.S - 1)]
    return mpmd_step(prog, durations, copies, _once_times(prog, priced, slow), cores,
                     getattr(priced, "dispatch_s", None) or 0.0, getattr(priced, "transfer_s", None) or 0.0)


def mpmd_step(prog, durations, latency, once, cores=None, dispatch_s=0, transfer_s=0):
    """The MPMD step of ``prog`` with these stage ``durations`` and exchange ``latency``
    (as ``simulate`` takes them) and per rank its ``once`` ops' time: one Python driver
    issues the instructions of ``driver_order`` one after another, ``dispatch_s`` per
    program and ``transfer_s`` per value moved, and no action starts before it is issued;
    each rank then runs its actions as soon as their inputs are there (the tick table
    simulated with those release times, the ranks sharing ``cores``). Each rank's once ops
    start when its last action has ended and they are issued, and share the cores with the
    other ranks'. Returns ``(the step's time, the SimResult, the driver's time)``."""
    from ..passes.pipeline.simulate import shared_finish
    from ..runtime.pipeline_mpmd import driver_order
    release, once_release, issued = {}, {}, 0
    for ins in driver_order(prog):
        issued += dispatch_s if ins[0] in ("run", "once") else transfer_s * ins[1]
        if ins[0] == "run":
            release[(ins[1], ins[2])] = issued
        elif ins[0] == "once":
            once_release[ins[1]] = issued
    sim = simulate(prog.schedule, durations, latency=latency, cores=cores, release=lambda d, a: release[(d, a)])
    last = [max((e.end for e in sim.events if e.stage == d), default=0) for d in range(prog.p)]
    end = shared_finish([(max(last[d], once_release[d]), once[d]) for d in range(prog.p)], cores)
    return max(end, sim.makespan, issued), sim, issued


def measured_host_step(prog, figures, lowering: str = "spmd", cost=None):
    """The host model's step of ``prog`` on ``figures`` (``pipeline_host.HostFigures``,
    measured by ``plan(measure=True)``) in place of the profile's: each
    action its measured time alone, the ranks sharing the measured ``Capacity``, the once
    ops their measured times; the SPMD lowering's ticks in lockstep (``spmd_step``), plus
    its idle loop where measured (else the exchanges at ``cost``'s link and the once ops
    alone), or the MPMD driver's release times at the measured
    dispatch and transfer costs (``mpmd_step``, an exchange a copy at ``cost``'s memory
    rate alone). Returns ``(seconds, the SimResult, the once phase's or the driver's
    seconds)``."""
    priced, _ = _priced(cost, None)
    durations, cores = figures.durations(prog), figures.capacity()
    if lowering == "mpmd":
        copies = [8 * _boundary_floats(prog, k) / priced.memory_bytes_per_s for k in range(prog.S - 1)]
        return mpmd_step(prog, durations, copies, list(figures.once), cores, figures.dispatch_s, figures.transfer_s)
    if figures.idle_loop is not None:
        # the actions in lockstep at their cost in the loop, and what the program does
        # beside them as measured: the exchanges, the once ops, the state's unpacking and packing
        loop, sim, _ = spmd_step(prog, figures.loop_durations(prog), 0.0, [0.0] * prog.p, cores)
        return loop + figures.idle_loop, sim, figures.idle_loop
    _, latency = _modeled_times(prog, priced)
    return spmd_step(prog, durations, latency, list(figures.once), cores)


def _modeled_bytes(prog, schedule, scale: float = 1.0, slots=None) -> int:
    """Bytes per device of a pipelined step: its state row, the accumulator, and the
    activation slots it keeps in flight (``slots``, or the schedule's peak per rank),
    each holding a micro-batch's stage input, the forward values kept for the backward
    and the cotangent received (``scale``: a micro-batch's rows relative to ``prog``'s):
    one micro-batch's work and what the pipeline keeps beside it (``_beyond_one``)."""
    one = (prog.A + prog.R + prog.G + prog.O) * scale
    return int(4 * (prog.state_size + one) + _beyond_one(prog, schedule, scale, slots))


def _beyond_one(prog, schedule, scale: float = 1.0, slots=None) -> float:
    """Bytes per device a pipelined step keeps beyond one micro-batch's work (what a plan of
    the step on one micro-batch counts): the accumulator, the activation slots of the
    other micro-batches in flight (``slots``, or the schedule's peak per rank,
    ``Schedule.peak_in_flight``, less the one running) and the other micro-batches'
    outputs."""
    n = slots if slots is not None else max(schedule.peak_in_flight())
    slot = (prog.A + prog.R + prog.G) * scale
    return 4 * (prog.ACC + (n - 1) * slot + (schedule.m - 1) * prog.O * scale)


def _state_elsewhere(prog, least: bool = False) -> float:
    """Bytes per device of the state a pipeline rank does not hold (the inputs other ranks
    store, the new state other ranks compute), the fewest over the ranks: what a plan of
    the whole step on one micro-batch counts beyond any one device of the pipeline (its
    arguments and outputs are alive throughout, ``passes/auto/memory.py``). In the plan's
    layouts (the per-rank program's local shapes), or with ``least`` at the fewest bytes
    any layout holds (the global size over every device of the sub-mesh)."""
    sub = prog.sub

    def nbytes(v, global_shape):
        shape = global_shape if least else v.aval.shape
        return math.prod(shape) * v.aval.dtype.itemsize / (sub.ranks if least else 1)
    held = [(v, sub.in_shapes[i], prog.ranks_of(i)) for i, v in enumerate(prog.j.invars) if prog.ranks_of(i)]
    seen = set(prog.j.invars)
    for n, (v, spec) in enumerate(zip(prog.j.outvars, prog.out_spec)):
        if spec[0] in ("packed", "shared") and v not in seen:
            seen.add(v)
            held.append((v, sub.out_shapes[n], (prog.rank_of(spec[1]),) if spec[0] == "packed" else tuple(spec[1])))
    return min(sum(nbytes(v, shape) for v, shape, ranks in held if d not in ranks) for d in range(prog.p))


class SearchRow(tuple):
    """One candidate of the ``"auto"`` search: ``(seconds, microbatches, schedule, bytes)``
    (modeled step and bytes per device), with ``reason`` (why it was rejected; empty when
    it fits), ``note`` (the search's description) and ``bounds`` (its cuts: per model
    stage the (first, end) forward op, when the cuts were searched too)."""

    def __new__(cls, seconds, microbatches, schedule, nbytes, *, reason="", note="", bounds=None):
        row = super().__new__(cls, (float(seconds), int(microbatches), str(schedule), int(nbytes)))
        row.reason, row.note, row.bounds = reason, note, bounds
        return row

    def __reduce__(self):
        return (_search_row, (tuple(self), self.reason, self.note, self.bounds))


def _primitives(closed) -> list:
    """The primitives of a traced program's equations, in order (two plans of one step
    at two batch sizes are the same program where these agree)."""
    return [e.primitive.name for e in closed.jaxpr.eqns]


def _search_row(values, reason, note, bounds):
    return SearchRow(*values, reason=reason, note=note, bounds=bounds)


@dataclass
class _Traces:
    jg: object          # the global batch's trace (planned per-rank program beside a sub-mesh)
    jm: object          # one device's micro-batch
    js: object          # the trace compared with jm for the batch dims
    sub: object
    mask: tuple
    out_tree: object
    ties: dict
    m: int
    md: int             # micro-batches times dp: one device's share of the batch
    marks: int          # forward stage_boundary marks
    consts: list        # the planned program's constants (inputs after the user's leaves)
    auto: object = None  # mode="auto": the sub-mesh search's result on the micro-batch (passes/auto SearchResult)


def _sources_in_place(leaves, owned, invars, p):
    """State that comes back as the ``PackedLeaf`` objects a step returned, read where it
    lies: the distinct packed buffers, and per rank each input's (buffer, offset)."""
    bufs, sources = {}, []
    desc = [dict() for _ in range(p)]
    for i, d in owned:
        lf = leaves[i]
        if id(lf.buffer) not in bufs:
            bufs[id(lf.buffer)] = len(sources)
            sources.append(lf.buffer)
        desc[d][invars[i]] = (bufs[id(lf.buffer)], lf.offset_on(d))
    return sources, desc


class _Compiled:
    def __init__(self, prog, out_tree, m, B, an, schedule):
        self.prog, self.out_tree, self.m, self.B, self.an, self.schedule = prog, out_tree, m, B, an, schedule
        self.fns = {}
        self.float_fn = prog.float_fn() if prog.float_outs else None


class PipelineFunction:
    """A step pipelined over the ``pipeline.axis`` mesh axis (see the module doc)."""

    def __init__(self, fn, *, mesh, pipeline: Pipeline, batch_argnums=None, dump_dir=None, memory_limit=None,
                 mode: str = "sharding_propagation", shard_optimizer_state=False, optimizer_argnums=(1,),
                 cost_model=None):
        if not isinstance(pipeline, Pipeline):
            raise ShardingError(f"pipeline={pipeline!r}: pass sp.Pipeline(microbatches=..., schedule=...)")
        self.fn, self.pipeline = fn, pipeline
        self.mesh_spec = resolve_mesh(mesh)
        self.p = check_pipeline(pipeline, self.mesh_spec.ir_mesh.axis_names, self.mesh_spec.ir_mesh.axis_sizes)
        self.mesh = self.mesh_spec.jax_mesh()
        # what the cuts, the search and the plan's modeled step are priced by (as parallelize's cost_model)
        self.cost_model = cost_model
        self.cost = resolve_cost_model(cost_model, self.mesh_spec.ir_mesh)
        sizes = dict(zip(self.mesh_spec.ir_mesh.axis_names, self.mesh_spec.ir_mesh.axis_sizes))
        self.mode, self.optimizer_argnums = mode, tuple(optimizer_argnums)
        # the axes beside the pipeline's: planned by the non-pipeline passes when any of them
        # carries tensor parallelism or ZeRO (compiler/pipeline_submesh.py); "dp" alone splits
        # each micro-batch over its devices without planning
        self.sub_axes = tuple(a for a in self.mesh_spec.ir_mesh.axis_names if a != pipeline.axis)
        self.zero_axes = () if not shard_optimizer_state else (
            (shard_optimizer_state,) if isinstance(shard_optimizer_state, str) else
            tuple(shard_optimizer_state) if isinstance(shard_optimizer_state, (tuple, list)) else ("dp",))
        if self.zero_axes and not set(self.zero_axes) <= {a for a in self.sub_axes if sizes[a] > 1}:
            raise ShardingError(f"shard_optimizer_state={shard_optimizer_state!r} with a pipeline: ZeRO-1 splits the "
                                f"optimizer state over data-parallel axes beside {pipeline.axis!r}, and the mesh has "
                                f"{dict(sizes)}; add a 'dp' axis, e.g. mesh=((2, 2, 2), ('pp', 'dp', 'mp'))")
        self.planned = bool(self.zero_axes) or any(sizes[a] > 1 for a in self.sub_axes if a != "dp") \
            or (mode != "sharding_propagation" and any(sizes[a] > 1 for a in self.sub_axes))
        self.sub_sizes = tuple(int(sizes[a]) for a in self.sub_axes)
        self.planned_dp = int(sizes.get("dp", 1)) if self.planned else 1
        self.dp = int(sizes.get("dp", 1)) if pipeline.axis != "dp" and not self.planned else 1
        self.batch_argnums = batch_argnums
        self.dump_dir = dump_dir
        from ..passes.auto.memory import parse_memory_limit
        self.memory_limit = parse_memory_limit(memory_limit)
        self._cache = {}
        self._traces = {}       # (arguments, m) -> _Traces: shared with _search's base step

    # ---------------------------------------------------------------- tracing
    def _batch_mask(self, args, leaves_per_arg):
        argnums = self.batch_argnums
        if argnums is None:
            argnums = (len(args) - 1,)
        elif isinstance(argnums, int):
            argnums = (argnums,)
        mask = []
        for a, n in enumerate(leaves_per_arg):
            mask += [a in argnums] * n
        return tuple(mask)

    def _flatten(self, args):
        leaves, treedef = jax.tree.flatten(args)
        per_arg = [len(jax.tree.leaves(a)) for a in args]
        mask = self._batch_mask(args, per_arg)
        avals = tuple(jax.ShapeDtypeStruct(tuple(x.shape), x.dtype) if isinstance(x, (PackedLeaf, jax.ShapeDtypeStruct))
                      else jax.ShapeDtypeStruct(tuple(np.shape(x)), jnp.result_type(x)) for x in leaves)
        return leaves, treedef, mask, avals

    def _compile(self, args):
        leaves, treedef, mask, avals = self._flatten(args)
        key = (treedef, avals, mask)
        if key in self._cache:
            return self._cache[key], leaves, mask
        if self.mode == "auto" and self.planned and self.memory_limit is not None:
            c = self._fit_submesh(args)
        else:
            c = self._build(args)
        self._cache[key] = c
        return c, leaves, mask

    def _fit_submesh(self, args):
        """``mode="auto"`` beside the pipeline under ``memory_limit``. A build's modeled peak
        per device (``device_peak``) is the sub-mesh search's peak of one micro-batch's step
        (every stage's state in it), less the state a device does not hold
        (``_state_elsewhere``), plus what the pipeline keeps beyond one micro-batch
        (``_beyond_one``). The step is built with the search free; while the peak is over
        the limit, it is built again with the search held to the limit less what the
        pipeline keeps, plus the other stages' state as the last plan laid it out (the
        cuts, m and the schedule may change with the plan, so each round counts again); the
        last round credits that state at the fewest bytes any layout gives it, so a plan
        the search finds there fits. Where the pipeline's own count (its state and slots)
        rejects every configuration under the free plan, a plan holding fewer bytes per
        device may still fit: the first rounds count from the free plan's build with the
        pipeline search not held to the limit."""
        from ..passes.auto.search import NoPlanFits
        limit = self.memory_limit
        try:
            c = self._build(args)
        except NoPipelineFits:
            c = self._build(args, hold_pipeline=False)
        free = c.device_peak if c.pipeline_held else None
        budget = None
        for n in range(FIT_ROUNDS):
            if c.device_peak <= limit and c.pipeline_held:
                return c
            credit = c.least_elsewhere if n == FIT_ROUNDS - 1 else c.elsewhere
            ask = max(1, int(limit - c.beyond_one + credit))
            budget = ask if budget is None else min(budget, ask)
            try:
                c = self._build(args, submesh_limit=budget)
            except NoPlanFits as e:
                raise self._submesh_overflow(e, budget, c, free) from e
        if c.device_peak <= limit:
            return c
        raise ShardingError(
            f"mode='auto' beside the pipeline: memory_limit={limit:,} bytes per device was not met after "
            f"{FIT_ROUNDS} rounds of holding the strategy search on the axes beside {self.pipeline.axis!r} to what "
            f"the pipeline leaves of it (last: {c.device_peak:,.0f} bytes per device): the configuration the "
            "pipeline search picks changes with the plan. Fix: raise memory_limit, or fix microbatches= and "
            "schedule= in sp.Pipeline")

    def _submesh_overflow(self, e, budget: int, last, free=None) -> ShardingError:
        """The error where the sub-mesh search finds no plan under ``budget``: the limit, how a
        device of the pipeline differs from the search's count (as ``last``, the build before,
        counted it), the least the search found, the free plan's peak per device (``free``,
        where the pipeline's own count took it) and the search's own words (the largest
        tensors at its peak)."""
        limit = self.memory_limit
        sizes = dict(zip(self.sub_axes, self.sub_sizes))
        least = e.smallest - last.least_elsewhere + last.beyond_one
        enough = least if free is None else min(least, free)
        return ShardingError(
            f"mode='auto' beside the pipeline: the strategy search on the axes beside {self.pipeline.axis!r} "
            f"{sizes} found no plan under memory_limit={limit:,} bytes per device. It counts one micro-batch's step "
            f"with every stage's state in it; a device of the pipeline holds {last.beyond_one:,.0f} bytes more (the "
            f"accumulator and up to {max(last.schedule.peak_in_flight())} micro-batches' activations in flight, "
            f"schedule {last.schedule.name!r} with {last.m} micro-batches) and at least "
            f"{last.least_elsewhere:,.0f} fewer (other stages' state). Held to {budget:,} bytes, the least it found "
            f"is {e.smallest:,.0f}, at most {least:,.0f} per device in the pipeline"
            + (f" (the plan without a budget: {free:,.0f})" if free is not None else "")
            + f". Fix: raise memory_limit to {enough:,.0f} or more, put more devices on the axes beside "
            f"{self.pipeline.axis!r}, use more pipeline stages, keep fewer micro-batches in flight (schedule='1f1b' "
            "rather than 'gpipe'), or shrink the batch or the model.\n  the search on one micro-batch's step: "
            f"{str(e).splitlines()[0]}")

    def _build(self, args, submesh_limit=None, hold_pipeline: bool = True):
        """The compiled step (not cached): its traces planned on the sub-mesh (the search held
        to ``submesh_limit`` bytes per device with ``mode="auto"``), the pipeline configuration
        searched where asked (its own count held to ``memory_limit`` unless ``hold_pipeline``
        is False), the analysis, the schedule and the program."""
        limit = self.memory_limit if hold_pipeline else None
        leaves, treedef, mask, avals = self._flatten(args)
        pl, p = self.pipeline, self.p
        m = pl.microbatches
        bsizes = {a.shape[0] for a, b in zip(avals, mask) if b and a.shape}
        if not any(mask):
            raise ShardingError("a pipeline splits the batch arguments into micro-batches, and this step has none: "
                                "pass batch_argnums= (default: the last positional argument)")
        if len(bsizes) != 1:
            raise ShardingError(f"the batch arguments' leading dims differ ({sorted(bsizes)}); every batch leaf "
                                "must have the batch as dim 0")
        B = bsizes.pop()
        v = pl.virtual_stages
        S = p * v
        auto = m == "auto" or pl.schedule == "auto"
        per_layer = isinstance(pl.stages, tuple)
        if per_layer and len(pl.stages) != S:
            raise ShardingError(f"Pipeline(stages={pl.stages}): {len(pl.stages)} layer counts for {S} model stages "
                                f"(pp={p} x virtual_stages={v}); give one count per model stage")
        search_rows = None
        if per_layer:
            # layer counts fix the cuts: only m and the schedule are searched (as with marks)
            if auto:
                pl, search_rows = self._search(args, B, submesh_limit, limit)
            m = pl.microbatches
            tr = self._trace(avals, mask, treedef, B, m, submesh_limit)
            if tr.marks:
                raise ShardingError(f"Pipeline(stages={pl.stages}) and {tr.marks} sp.stage_boundary marks: give the "
                                    "cuts one way, by layer counts or by marks")
            one = analyse(tr.jg, tr.jm, tr.js, tr.mask, S=1, m=tr.md, global_batch=B, auto=True)
            an = auto_stages(one, p=p, v=v, bounds=layer_bounds(one, pl.stages))
        else:
            ms = self._microbatch_options(B) if m == "auto" else [m]
            tr = self._trace(avals, mask, treedef, B, ms[len(ms) // 2], submesh_limit)
            if tr.marks == 0:
                # no marks: the cuts, m and the schedule in one search (passes/pipeline/search.py)
                one = analyse(tr.jg, tr.jm, tr.js, tr.mask, S=1, m=tr.md, global_batch=B, auto=True)
                best, search_rows = self._search_cuts(one, tr, B, ms, limit=limit)
                pl = replace(pl, microbatches=best.microbatches, schedule=best.schedule)
                if best.microbatches != tr.m:
                    priced, tr = tr, self._trace(avals, mask, treedef, B, best.microbatches, submesh_limit)
                    one = analyse(tr.jg, tr.jm, tr.js, tr.mask, S=1, m=tr.md, global_batch=B, auto=True)
                    if _primitives(priced.jm) != _primitives(tr.jm):
                        # the sub-mesh search planned this micro-batch's step otherwise (a memory budget
                        # binds at one size and not the other): the cuts are priced on this program
                        best, again = self._search_cuts(one, tr, B, [best.microbatches], (best.schedule,), limit)
                        search_rows = again + search_rows
                an = auto_stages(one, p=p, v=v, bounds=best.cuts.bounds)
            else:
                if auto:
                    pl, search_rows = self._search(args, B, submesh_limit, limit)
                    if pl.microbatches != tr.m:
                        tr = self._trace(avals, mask, treedef, B, pl.microbatches, submesh_limit)
                an = analyse(tr.jg, tr.jm, tr.js, tr.mask, S=S, m=tr.md, global_batch=B)
        m, mask, sub = pl.microbatches, tr.mask, tr.sub
        schedule = build_schedule(pl.schedule, p, m, pl.virtual_stages, forward_only=not an.training)
        sim = simulate(schedule, UNIT)
        prog = PipelineProgram(an, schedule, sim, mesh=self.mesh, axis=pl.axis, m=m, batch_mask=mask,
                               dp_axis="dp" if self.dp > 1 else None, sub=sub,
                               ties=tr.ties)
        if sub is not None:
            self._check_planned_outputs(prog)
        c = _Compiled(prog, tr.out_tree, m, B, an, schedule)
        c.pipeline_config = pl
        c.search = search_rows
        c.stage_times, c.latency = _modeled_times(prog, self.cost)
        c.model_sim = simulate(schedule, stage_durations(prog, c.stage_times), latency=c.latency)
        c.paths = [jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
        c.sub, c.consts = sub, tr.consts
        c.paths += [f"<constant {n}>" for n in range(len(c.consts))]
        # mode="auto" beside the pipeline: the search's peak of one micro-batch's step and
        # what the pipeline keeps beyond it, the schedule's in-flight count as its search's
        searched = tr.auto is not None
        c.submesh_budget, c.pipeline_held = submesh_limit, hold_pipeline
        c.submesh_peak = float(tr.auto.peak_memory) if searched else 0.0
        c.beyond_one = _beyond_one(prog, schedule) if searched else 0.0
        c.elsewhere = _state_elsewhere(prog) if searched else 0.0
        c.least_elsewhere = _state_elsewhere(prog, least=True) if searched else 0.0
        c.device_peak = c.submesh_peak - c.elsewhere + c.beyond_one
        return c

    def _plan_submesh(self, jg, jm, js, avals, micro, doubled, mask, treedef, out_tree, limit=None):
        """The three traces (global, micro-batch, shape) planned on the sub-mesh
        (``compiler/pipeline_submesh.py``): their per-rank programs, the sub-mesh's layouts,
        the batch mask over the per-rank program's inputs (the graph's constants are
        inputs after the user's leaves) and, with ``mode="auto"``, the search's result on
        the micro-batch (held to ``limit`` bytes per device). One plan must serve every
        batch size."""
        from ..runtime.mesh import resolve_mesh as _resolve
        from ..runtime.pipeline_lower import SubMesh
        from .pipeline_submesh import plan_submesh, zero_pins
        from .trace import input_names
        spec = _resolve((self.sub_sizes, self.sub_axes))
        jmesh = spec.jax_mesh()
        names = input_names(self.fn, tuple(jax.tree.unflatten(treedef, list(avals))), {})
        batch_argnums = self._batch_argnums(treedef)

        def outs_of(closed):
            return jax.tree.unflatten(out_tree, [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                                                 for v in closed.jaxpr.outvars])
        pins = zero_pins(jm, names, ir_mesh=spec.ir_mesh, batch_mask=mask, arg_leaves=list(micro),
                         args_tree=treedef, out_shape=outs_of(jm), mode=self.mode, zero_axes=self.zero_axes,
                         optimizer_argnums=self.optimizer_argnums, batch_argnums=batch_argnums) \
            if self.zero_axes else {}

        replay = {}   # the micro-batch's step chooses its strategies, the other traces take its plan

        def planned(closed, leaves):
            outs = outs_of(closed)
            return plan_submesh(closed, names, ir_mesh=spec.ir_mesh, jax_mesh=jmesh, batch_mask=mask,
                                arg_leaves=list(leaves), args_tree=treedef, out_shape=outs, mode=self.mode,
                                pins=pins, batch_argnums=batch_argnums, cost=self.cost, replay=replay,
                                memory_limit=limit, in_branches=self.pipeline.lowering != "mpmd")
        pm = planned(jm, micro)
        pg = planned(jg, avals) if jm is not jg else pm
        ps = pg if js is jg else planned(js, doubled)
        for other in (pg, ps):
            self._same_plan(pm, other)
        self._consts = pm.consts
        n_user = len(avals)
        full_mask = tuple(mask) + (False,) * (len(pm.jaxpr.jaxpr.invars) - n_user)
        gshape = lambda x: tuple(x.shape)   # noqa: E731
        sub = SubMesh(self.sub_axes, self.sub_sizes, tuple(pm.in_dims), tuple(pm.out_dims),
                      tuple([gshape(a) for a in avals] + [tuple(np.shape(c)) for c in pm.consts]),
                      tuple(pm.global_out_shapes))
        return pg.jaxpr, pm.jaxpr, ps.jaxpr, sub, full_mask, getattr(pm.graph, "auto", None)

    @staticmethod
    def _same_plan(pm, other) -> None:
        """The analysis reads one program at two batch sizes: the sub-mesh plans of both must
        agree (propagation prices moves by bytes, so a choice can flip with the rows)."""
        from .source_lines import source_of
        if other is pm:
            return
        a, b = pm.jaxpr.jaxpr.eqns, other.jaxpr.jaxpr.eqns
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x.primitive != y.primitive),
                    None if len(a) == len(b) else min(len(a), len(b)))
        if diff is None and other.in_specs == pm.in_specs and other.out_specs == pm.out_specs:
            return
        where = ""
        if diff is not None and diff < len(a):
            e = a[diff]
            other_op = b[diff].primitive.name if diff < len(b) else "nothing"
            where = f" (first difference: {e.primitive.name} against {other_op} at {source_of(e.source_info)})"
        raise ShardingError("the plan of the pipelined step on the mesh axes beside the pipeline's differs between "
                            f"a micro-batch and the whole batch{where}: propagation (or, with mode='auto', the "
                            "search) chose differently at the two sizes, and a pipeline needs one per-rank program "
                            "for both. Fix the layouts there with sp.shard marks, use another micro-batch count, or "
                            "(under mode='auto') plan with mode='sharding_propagation'")

    def _state_ties(self, avals, treedef, jg, out_tree) -> dict:
        """{output leaf: input leaf} of the state the step returns (``compiler/state.py``
        ``state_ties`` over every argument but the batch): where a new value goes back."""
        from .state import state_ties
        args = jax.tree.unflatten(treedef, list(avals))
        outs = jax.tree.unflatten(out_tree, [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                                             for v in jg.jaxpr.outvars])
        batch = self._batch_argnums(treedef)
        return state_ties(args, [a for a in range(len(args)) if a not in batch], outs)

    def _batch_argnums(self, treedef) -> tuple:
        n = len(treedef.children())
        argnums = self.batch_argnums
        if argnums is None:
            return (n - 1,)
        return (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def _check_planned_outputs(self, prog) -> None:
        for v, s_ in zip(prog.j.outvars, prog.out_spec):
            if s_[0] == "float":
                reads = prog._reads(prog.float_idxs)
                split = [r for r in reads if r in prog.invar_index and any(prog.sub.in_dims[prog.invar_index[r]])]
                if split:
                    raise ShardingError("a pipelined step's output computed from inputs only reads an input split "
                                        "over the tensor-parallel axes: not yet supported; compute it outside the "
                                        "step")

    def _check_m(self, B: int, m: int) -> None:
        dp = max(self.dp, self.planned_dp)
        if B % m == 0 and (B // m) % dp:
            raise ShardingError(f"Pipeline(microbatches={m}) on a mesh with dp={dp}: a micro-batch of {B // m} "
                                f"rows (batch {B} / {m}) does not split over {dp} data-parallel devices; use a "
                                f"batch that is a multiple of {m * dp}")
        if B % m:
            good = [d for d in range(1, B + 1) if B % d == 0]
            near = min(good, key=lambda d: (abs(d - m), d))
            raise ShardingError(f"Pipeline(microbatches={m}) does not divide the batch of {B} rows (batch "
                                f"arguments' dim 0): use a micro-batch count that divides {B}, e.g. {near}, or a "
                                f"batch that is a multiple of {m}")

    def _trace(self, avals, mask, treedef, B: int, m: int, submesh_limit=None) -> "_Traces":
        """The step traced on the global batch, on one device's micro-batch (the batch over
        ``m`` and dp) and, with one micro-batch of the whole batch, on twice the batch (to
        find the batch dims); planned on the sub-mesh when it has tensor-parallel axes (the
        search held to ``submesh_limit`` bytes per device)."""
        self._check_m(B, m)
        key = (treedef, tuple(avals), tuple(mask), m, submesh_limit)
        if key in self._traces:
            return self._traces[key]
        out_tree = []

        def flat_fn(*ls):
            out = self.fn(*jax.tree.unflatten(treedef, ls))
            o, t = jax.tree.flatten(out)
            out_tree.append(t)
            return o

        def scaled(f):
            return [jax.ShapeDtypeStruct((a.shape[0] * f // 1,) + a.shape[1:] if b else a.shape, a.dtype)
                    if b else a for a, b in zip(avals, mask)]
        md = m * self.dp    # one device's micro-batch: the batch over micro-batches and dp
        micro = [jax.ShapeDtypeStruct((a.shape[0] // md,) + a.shape[1:], a.dtype) if b else a
                 for a, b in zip(avals, mask)]
        jg = inline_calls(jax.make_jaxpr(flat_fn)(*avals))
        jm = inline_calls(jax.make_jaxpr(flat_fn)(*micro)) if md > 1 else jg
        js = jg if md > 1 else inline_calls(jax.make_jaxpr(flat_fn)(*scaled(2)))
        sub, ties = None, self._state_ties(avals, treedef, jg, out_tree[0])   # (global shapes: before planning)
        tmask, auto = mask, None
        if self.planned:
            jg, jm, js, sub, tmask, auto = self._plan_submesh(jg, jm, js, avals, micro,
                                                              scaled(2) if md == 1 else None, mask, treedef,
                                                              out_tree[0], submesh_limit)
        marks = sum(1 for e in jm.jaxpr.eqns
                    if e.primitive.name == "stage_boundary" and e.params["direction"] == "forward")
        self._traces[key] = _Traces(jg, jm, js, sub, tmask, out_tree[0], ties, m, md, marks,
                                    list(getattr(self, "_consts", [])) if self.planned else [], auto)
        return self._traces[key]

    def _microbatch_options(self, B: int) -> list:
        """``microbatches="auto"``: the counts that split the batch (over dp too) into
        micro-batches of 2 rows or more (one row traces differently), up to ``8 p``; a
        multiple of ``p`` for interleaved."""
        p, v = self.p, self.pipeline.virtual_stages
        dp = max(self.dp, self.planned_dp)
        per_dev = B // dp if B % dp == 0 else B
        ms = [d for d in range(1, min(per_dev // 2, 8 * p) + 1) if B % (d * dp) == 0 and B // (d * dp) >= 2]
        if v > 1:
            ms = [d for d in ms if d % p == 0]
        if not ms:
            raise ShardingError(f"Pipeline(microbatches=\"auto\"): no micro-batch count splits the batch of {B} "
                                f"rows into micro-batches of 2 rows or more{' (a multiple of p for interleaved)' if v > 1 else ''}")
        return ms

    def _schedule_options(self) -> tuple:
        pl = self.pipeline
        if pl.schedule != "auto":
            return (pl.schedule,)
        return ("interleaved",) if pl.virtual_stages > 1 else ("gpipe", "1f1b", "zero_bubble")

    def _search_cuts(self, one, tr, B: int, ms: list, schedules=None, limit=None):
        """No marks: the cuts, the micro-batch count and the schedule chosen together by
        ``passes/pipeline/search.py`` ``search_pipeline`` on the mesh's pp x dp x tp, every
        forward op a layer (``pipeline_assign.layer_costs``, priced by the step's cost
        model on the traced micro-batch; pp's exchanges with their latency, the schedule's
        bubble by the simulator, the activations in flight under ``memory_limit``).
        ``schedules``: the schedules to search (default: as the pipeline asks); ``limit``: the
        bytes per device its count is held to. Returns the best ``Candidate`` and every
        candidate as ``SearchRow``s."""
        from ..passes.pipeline.search import search_pipeline
        p, v = self.p, self.pipeline.virtual_stages
        dp = max(self.dp, self.planned_dp)
        tp = int(np.prod(self.sub_sizes)) // dp if self.planned else 1
        F = len(one.stages[0].forward)
        if F < p * v:
            raise ShardingError(f"automatic cuts: the forward has {F} ops for {p * v} stages; mark the cuts with "
                                "sp.stage_boundary")
        jm, jg = tr.jm.jaxpr, tr.jg.jaxpr
        ratio = 1.0
        for vm, vg in zip(jm.invars, jg.invars):
            bd = one.bdim.get(vm)
            if bd is not None and jg is not jm:
                ratio = vg.aval.shape[bd] / vm.aval.shape[bd]
                break
        costs = layer_costs(one, lambda e: _eqn_time(e, self.cost), rows=B // (tr.m * dp),
                            global_op_time=(lambda i: _eqn_time(jg.eqns[i], self.cost)) if ratio > 1 else None,
                            row_ratio=ratio)
        # at most CUT_WINDOWS layers (at least STAGE_WINDOWS per stage): per window of the
        # forward's time its cheapest allowed cut point, as plan_step cuts a planned stage
        # (passes/pipeline/cuts.py cut_windows, as compiler/planning.py), so the DP stays over ~100 layers
        starts = list(range(F))
        windows = max(CUT_WINDOWS, STAGE_WINDOWS * p * v)
        if F > windows:
            points = cut_windows(list(costs.exchange_bytes), [f + b for f, b in zip(costs.forward_s,
                                                                                  costs.backward_s)], windows)
            costs, starts = merge_layers(costs, points)
            if costs.layers < p * v:
                raise ShardingError(f"automatic cuts: only {costs.layers - 1} places to cut the forward for "
                                    f"{p * v} stages; mark the cuts with sp.stage_boundary")
        schedules = schedules or self._schedule_options()
        if not one.training and self.pipeline.schedule == "auto" and v == 1:
            schedules = ("gpipe",)       # forward only: every schedule runs GPipe's forward half
        res = search_pipeline(costs, devices=p * dp * tp, batch=B, cost=self.cost, pp=p, dp=dp, tp=tp,
                              microbatches=ms, schedules=schedules,
                              virtual_stages=(v,) if v > 1 else (2,), memory_limit=limit,
                              axis_names=(self.pipeline.axis, "dp", "mp"))
        best = res.best
        balanced = self._balanced_cuts(costs, best, B=B, dp=dp, tp=tp, limit=limit)
        rows = [SearchRow(c.step_s, c.microbatches, c.schedule, int(c.memory_bytes),
                          note=c.describe(), bounds=c.cuts.bounds if c.cuts is not None else None)
                for c in res.ranked]
        if balanced is not None:
            best = balanced
            rows.insert(0, SearchRow(balanced.step_s, balanced.microbatches, balanced.schedule,
                                     int(balanced.memory_bytes), bounds=balanced.cuts.bounds,
                                     note=f"{balanced.describe()}; the compute-balanced cuts, within "
                                          f"{TIE_TOLERANCE:.0%} of the search's best (next row): taken"))
        rows += [SearchRow(math.inf, c.microbatches, c.schedule, int(c.memory_bytes), reason=c.reason,
                           note=c.describe()) for c in res.rejected]
        # bounds in merged layers -> forward op positions
        edge = lambda k: starts[k] if k < len(starts) else F   # noqa: E731
        to_ops = lambda bounds: tuple((edge(a), edge(b)) for a, b in bounds) if bounds else bounds  # noqa: E731
        for r in rows:
            r.bounds = to_ops(r.bounds)
        best = replace(best, cuts=replace(best.cuts, bounds=to_ops(best.cuts.bounds)))
        return best, rows

    def _balanced_cuts(self, costs, best, *, B: int, dp: int, tp: int, limit=None):
        """The compute-balanced cuts for the search's best (m, schedule) when they are
        priced within ``TIE_TOLERANCE`` of its own cuts, else None. A model whose exchange
        latency dwarfs the ops (small layers on a GPU-like model) prices every cut almost
        alike, and then the cut it prefers hangs on nanoseconds; balanced compute is the
        choice that does not. Priced by the same search on the layers merged into the
        balanced stages (one way to cut them), so no cost is computed twice."""
        from ..passes.pipeline import plan_cuts
        from ..passes.pipeline.search import search_pipeline
        p, v, m = best.pp, best.virtual_stages, best.microbatches
        fwd, bwd, _, _ = costs.at_rows(B // (dp * m))
        # the least bottleneck (the formula at many micro-batches: the slowest stage's compute)
        bounds = plan_cuts([f + b for f, b in zip(fwd, bwd)], p, 64 * p, best.schedule, v, objective="formula",
                           boundary_time=[math.inf if math.isinf(x) else 0.0 for x in costs.exchange_bytes]).bounds
        if bounds == best.cuts.bounds:
            return None
        merged, _ = merge_layers(costs, [b - 1 for _, b in bounds[:-1]])
        try:
            c = search_pipeline(merged, devices=p * dp * tp, batch=B, cost=self.cost, pp=p, dp=dp, tp=tp,
                                microbatches=m, schedules=(best.schedule,), virtual_stages=(max(v, 2),),
                                memory_limit=limit, axis_names=(self.pipeline.axis, "dp", "mp")).best
        except ShardingError:
            return None           # the balanced cuts break the memory limit
        if c.step_s > best.step_s * (1 + TIE_TOLERANCE):
            return None
        from dataclasses import replace as _replace
        return _replace(c, cuts=_replace(c.cuts, bounds=bounds))

    def _search(self, args, B: int, submesh_limit=None, limit=None):
        """With the cuts fixed (marks, or layer counts): the (schedule, m) of least modeled
        step time. One trace at a base micro-batch count gives each stage's per-micro-batch
        times; a micro-batch of ``1/m`` of the batch takes them scaled by ``m0/m`` (its rows),
        the exchanges' bytes likewise (their latency stays); each candidate is simulated, its
        modeled bytes per device held to ``limit``. Returns the chosen ``Pipeline`` and every
        candidate as ``SearchRow``s."""
        pl, p, v = self.pipeline, self.p, self.pipeline.virtual_stages
        ms = [pl.microbatches] if pl.microbatches != "auto" else self._microbatch_options(B)
        names = self._schedule_options()
        m0 = ms[len(ms) // 2]
        base = PipelineFunction(self.fn, mesh=self.mesh, pipeline=replace(pl, microbatches=m0, schedule=(
            "interleaved" if v > 1 else "1f1b")), batch_argnums=self.batch_argnums, mode=self.mode,
            shard_optimizer_state=self.zero_axes or False, optimizer_argnums=self.optimizer_argnums,
            cost_model=self.cost_model)
        base._traces = self._traces          # the same step, mesh and options: the same traces
        c0 = base._build(args, submesh_limit)
        rows = []
        for name in names:
            for m in ms:
                sch = build_schedule(name, p, m, v, forward_only=not c0.an.training)
                scale = m0 / m
                t = c0.stage_times
                dur = {}
                for kind in ("forward", "backward", "backward_input", "backward_weight"):
                    if all(kind in x for x in t):
                        dur[kind] = [x[kind] * scale for x in t]
                if name == "zero_bubble" and "backward_input" not in dur and "backward" in dur:
                    dur["backward_input"] = [b / 2 for b in dur["backward"]]
                    dur["backward_weight"] = [b / 2 for b in dur["backward"]]
                lat = [self.cost.latency_s + (x - self.cost.latency_s) * scale for x in c0.latency]
                nbytes = _modeled_bytes(c0.prog, sch, scale)
                over = limit is not None and nbytes > limit
                rows.append(SearchRow(float(simulate(sch, dur, latency=lat).makespan), m, name, nbytes,
                                      reason=f"memory: {nbytes} bytes per device > memory_limit="
                                             f"{limit}" if over else ""))
        rows.sort()
        fits = [r for r in rows if not r.reason]
        if not fits:
            least = min(rows, key=lambda r: r[3])
            raise NoPipelineFits(f"no pipeline fits memory_limit={limit} bytes per device: the least, "
                                 f"{least[3]} bytes (microbatches={least[1]}, schedule={least[2]!r}); raise the "
                                 "limit, use more pipeline stages or a smaller batch")
        best = fits[0]
        return replace(pl, microbatches=best[1], schedule=best[2]), fits + [r for r in rows if r.reason]

    # ---------------------------------------------------------------- running
    def _inputs(self, c, leaves):
        if c.sub is not None:
            return self._inputs_sub(c, list(leaves) + list(c.consts))
        prog, p = c.prog, self.p
        owned = [(i, d) for i in range(len(prog.owner)) for d in prog.ranks_of(i)]
        in_place = all(isinstance(leaves[i], PackedLeaf) and leaves[i].offset_on(d) is not None for i, d in owned)
        invars = prog.j.invars
        if in_place and owned:
            sources, desc = _sources_in_place(leaves, owned, invars, p)
        else:
            rows = np.zeros((p, prog.state_size), np.float32)
            for i, d in owned:
                off = prog.state_pack[d].offset[invars[i]]
                flat = np_to_f32(np.asarray(leaves[i]))
                rows[d, off:off + flat.size] = flat
            sources = [jax.device_put(rows, NamedSharding(self.mesh, P(self.pipeline.axis)))]
            desc = [{v: (0, prog.state_pack[d].offset[v]) for v in prog.state_pack[d].vars} for d in range(p)]
        rep = {i: self._replicated_input(leaves[i]) for i, d in enumerate(prog.owner) if d == -1}
        batch = {}
        for i, d in enumerate(prog.owner):
            if d == "batch":
                x = jnp.asarray(leaves[i])
                batch[i] = x.reshape((c.m, x.shape[0] // c.m) + x.shape[1:])
        return sources, desc, rep, batch

    def _replicated_input(self, x):
        """An input every rank reads, as the step's program takes it: the step's own output
        (on the mesh) as it is; host data, a packed leaf, or an array committed to other
        devices (Adam's step count restored by ``sp.Checkpointer`` onto the device it was
        saved from) as an uncommitted array that jit places, as a first call's."""
        if isinstance(x, jax.Array) and (x.sharding.device_set == set(self.mesh.devices.flat) or not x.committed):
            return x
        return jnp.asarray(np.asarray(x))

    def _inputs_sub(self, c, leaves):
        """``_inputs`` over a sub-mesh: each (pipeline rank, sub-mesh rank) holds its blocks
        of its stage's state (a ``(p, ranks, size)`` array); replicated and batch inputs go
        in under their planned layouts."""
        prog, p, sub = c.prog, self.p, c.sub
        ax = self.pipeline.axis
        owned = [(i, d) for i in range(len(prog.owner)) for d in prog.ranks_of(i)]
        invars = prog.j.invars
        in_place = all(isinstance(leaves[i], PackedLeaf) and leaves[i].offset_on(d) is not None
                       and leaves[i].sub == sub and leaves[i].dims == sub.in_dims[i] for i, d in owned)
        if in_place and owned:
            sources, desc = _sources_in_place(leaves, owned, invars, p)
        else:
            rows = np.zeros((p, sub.ranks, prog.state_size), np.float32)
            for i, d in owned:
                off = prog.state_pack[d].offset[invars[i]]
                blocks = pack_blocks(np.asarray(leaves[i]), sub, sub.in_dims[i])
                rows[d, :, off:off + blocks.shape[1]] = blocks
            sources = [jax.device_put(rows, NamedSharding(self.mesh, P(ax, tuple(sub.axes))))]
            desc = [{v: (0, prog.state_pack[d].offset[v]) for v in prog.state_pack[d].vars} for d in range(p)]
        rep = {i: jax.device_put(np.asarray(leaves[i]), NamedSharding(self.mesh, sub.spec(sub.in_dims[i])))
               for i in prog.rep_inputs()}
        batch = {}
        for i in prog.batch_inputs():
            x = np.asarray(leaves[i])
            x = x.reshape((c.m, x.shape[0] // c.m) + x.shape[1:])
            batch[i] = jax.device_put(x, NamedSharding(self.mesh, P(None, *sub.spec(sub.in_dims[i]))))
        return sources, desc, rep, batch

    def _fn(self, c, sources, desc):
        key = (len(sources), tuple(tuple(desc[d][v] for v in c.prog.state_pack[d].vars) for d in range(self.p)))
        if key not in c.fns:
            c.fns[key] = c.prog.build(len(sources), desc)
        return c.fns[key]

    def __call__(self, *args):
        c, leaves, mask = self._compile(args)
        if self.dump_dir and not getattr(c, "dumped", False):
            c.dumped = True
            self.plan(*args)
        if self.pipeline.lowering == "mpmd":
            return self._call_mpmd(c, leaves)
        prog = c.prog
        sources, desc, rep, batch = self._inputs(c, leaves)
        packed, bvals, out_buf, reps = self._fn(c, sources, desc)(sources, rep, batch)
        floats = []
        if c.float_fn is not None:
            need = [prog.invar_index[v] for v in prog._reads(prog.float_idxs) if v in prog.invar_index]
            allv = list(leaves) + list(c.consts)
            floats = c.float_fn({i: (np.asarray(allv[i]) if isinstance(allv[i], PackedLeaf) else allv[i])
                                 for i in need})
        outs, fi, ri, bi = [], 0, 0, {v: n for n, v in enumerate(prog.bcast_vars)}
        for v, s in zip(prog.j.outvars, prog.out_spec):
            if s[0] == "literal":
                outs.append(jnp.asarray(s[1]))
            elif s[0] == "input":
                outs.append(leaves[s[1]])
            elif s[0] == "float":
                outs.append(floats[fi])
                fi += 1
            elif s[0] == "rep":
                outs.append(reps[ri])
                ri += 1
            elif s[0] == "bcast":
                outs.append(bvals[bi[v]])
            elif s[0] == "shared":
                # a tied weight's new value: on each of its owners' rows
                d, n = s[1][0], len(outs)
                others = tuple((e, prog.out_state_pack[e].offset[v]) for e in s[1][1:])
                shape, dims = ((c.sub.out_shapes[n], c.sub.out_dims[n]) if c.sub is not None
                               else (tuple(v.aval.shape), None))
                outs.append(PackedLeaf(packed, d, prog.out_state_pack[d].offset[v], shape, v.aval.dtype, dims,
                                       c.sub, others))
            elif s[0] == "packed" and c.sub is not None:
                d, n = prog.rank_of(s[1]), len(outs)
                outs.append(PackedLeaf(packed, d, prog.out_state_pack[d].offset[v], c.sub.out_shapes[n],
                                       v.aval.dtype, c.sub.out_dims[n], c.sub))
            elif s[0] == "packed":
                d = prog.rank_of(s[1])
                outs.append(PackedLeaf(packed, d, prog.out_state_pack[d].offset[v], tuple(v.aval.shape),
                                       v.aval.dtype))
            else:
                outs.append(self._batched_out(c, v, s[1], out_buf))
        return jax.tree.unflatten(c.out_tree, outs)

    def mpmd(self, *args):
        """The MPMD program of these arguments (``Pipeline(lowering="mpmd")``):
        ``runtime/pipeline_mpmd.py`` ``MpmdProgram``, built on the plan's program."""
        return self._mpmd_of(self._compile(args)[0])

    def _mpmd_of(self, c):
        if getattr(c, "mpmd", None) is None:
            from ..runtime.pipeline_mpmd import MpmdProgram
            devs = np.asarray(self.mesh.devices)
            ax = list(self.mesh.axis_names).index(self.pipeline.axis)
            c.mpmd = MpmdProgram(c.prog, [np.take(devs, d, axis=ax) for d in range(self.p)])
        return c.mpmd

    def _call_mpmd(self, c, leaves):
        prog = c.prog
        allv = list(leaves) + list(c.consts)    # a planned sub-mesh's constants are inputs after the user's
        outs = self._mpmd_of(c)(allv)
        if c.float_fn is not None:
            # outputs computed from the inputs alone, as the SPMD path computes them
            need = [prog.invar_index[v] for v in prog._reads(prog.float_idxs) if v in prog.invar_index]
            floats = iter(c.float_fn({i: allv[i] for i in need}))
            outs = [next(floats) if s[0] == "float" else o for o, s in zip(outs, prog.out_spec)]
        return jax.tree.unflatten(c.out_tree, outs)

    def _batched_out(self, c, v, k, out_buf):
        prog = c.prog
        base, pk = prog.out_pack[k]
        o = base + pk.offset[v]
        n = int(np.prod(v.aval.shape))
        if c.sub is not None:
            return self._batched_out_sub(c, v, o, out_buf)
        x = out_buf[..., o:o + n]          # (dp, m, n): device j of dp holds rows j of each micro-batch
        from ..runtime.pipeline_lower import _from_f32
        x = _from_f32(x, (self.dp, c.m) + tuple(v.aval.shape), v.aval.dtype)
        x = jnp.swapaxes(x, 0, 1).reshape((c.m * self.dp,) + tuple(v.aval.shape))
        bd = c.an.bdim[v]
        x = jnp.moveaxis(x, 0, bd)
        shape = list(v.aval.shape)
        shape[bd] *= c.m * self.dp
        return x.reshape(shape)

    @staticmethod
    def _batched_out_sub(c, v, o, out_buf):
        """A per-example output beside a sub-mesh: ``out_buf`` is ``(ranks, m, O)``, each
        sub-mesh rank's block of each micro-batch's value under the output's planned layout
        from ``o``; the micro-batches' values, joined along the batch dim in order."""
        from ..runtime.distributed import to_numpy
        from ..runtime.pipeline_lower import unpack_blocks
        sub, out = c.sub, list(c.prog.j.outvars).index(v)
        shape, dims = tuple(sub.out_shapes[out]), sub.out_dims[out]
        buf = to_numpy(out_buf)   # (over several processes each holds some ranks' blocks)
        parts = [unpack_blocks(buf[:, mb], o, sub, shape, dims, v.aval.dtype) for mb in range(c.m)]
        return jnp.asarray(np.concatenate(parts, axis=c.an.bdim[v]))

    # ---------------------------------------------------------------- plan
    def plan(self, *args, measure: bool = False) -> PipelinePlan:
        """The plan of the step on ``args``. ``measure=True`` also times its stage programs
        on this host, alone and the ranks at once (``compiler/pipeline_host.py``), and
        models ``host_step_time`` on those figures (kept in ``pipeline.host_figures``)
        instead of the cost model's."""
        c, leaves, mask = self._compile(args)
        prog, an, sch = c.prog, c.an, c.schedule
        names = lambda idxs: [an.jaxpr.jaxpr.eqns[i].primitive.name for i in idxs]
        devs = np.asarray(self.mesh.devices)
        ax = list(self.mesh.axis_names).index(self.pipeline.axis)
        stages = []
        for k in range(prog.S):
            d, ch = sch.placement(k)
            rank_devs = tuple(int(x.id) for x in np.asarray(np.take(devs, d, axis=ax)).reshape(-1))
            st = an.stages[k]
            owned = [(c.paths[i], tuple(prog.j.invars[i].aval.shape)) for i in range(len(prog.owner))
                     if d in prog.ranks_of(i) and (
                         any(prog.j.invars[i] in prog.progs[(kind, k)]["reads"] for kind in prog.kinds)
                         or prog.j.invars[i] in prog.once[k]["reads"] or prog.j.invars[i] in prog.rep_reads)]
            stages.append(StageInfo(k, d, ch, rank_devs, names(st.forward), names(st.backward), names(st.once),
                                    owned))
        info = PipelineInfo(stages, dict(prog.sim.tick_table), float(c.model_sim.bubble), prog.T, c.m,
                            sch.name, prog.sim, c.model_sim, prog.nslots, step_time=float(c.model_sim.makespan),
                            unit_bubble=float(simulate(sch).bubble), stage_times=c.stage_times, search=c.search,
                            memory=_modeled_bytes(prog, sch, slots=prog.nslots),
                            host_step_time=(mpmd_host_step if self.pipeline.lowering == "mpmd" else host_step)(
                                prog, self.cost, core_share(self.mesh, self.p, self.cost, prog))[0],
                            submesh_peak=c.submesh_peak, state_elsewhere=c.elsewhere,
                            beyond_one_microbatch=c.beyond_one, device_peak=c.device_peak,
                            submesh_budget=c.submesh_budget)
        if measure:
            from .pipeline_host import measure_host
            programs = idle = ranks = None
            if self.pipeline.lowering != "mpmd":
                # the SPMD lowering's own actions (its branches) and what it does beside them
                from .pipeline_host import branch_programs, rank_devices
                _, _, rep, batch = self._inputs(c, leaves)
                programs = branch_programs(prog, rank_devices(prog), rep, batch)
                idle = self._idle_loop(c, leaves)
                ranks = [self._idle_loop(c, leaves, acting=(d,)) for d in range(self.p)]
            info.host_figures = measure_host(prog, programs=programs, idle_loop=idle, rank_loops=ranks)
            info.host_step_time = measured_host_step(prog, info.host_figures, self.pipeline.lowering, self.cost)[0]
        plan = PipelinePlan(info, prog)
        if self.dump_dir:
            import os
            os.makedirs(self.dump_dir, exist_ok=True)
            with open(os.path.join(self.dump_dir, "pipeline.txt"), "w") as f:
                f.write(info.text() + "\n")
            for d in range(self.p):
                with open(os.path.join(self.dump_dir, f"pipeline_rank{d}.txt"), "w") as f:
                    f.write(info.rank_text(d) + "\n")
            info.to_html(os.path.join(self.dump_dir, "pipeline.html"))
        return plan

    def idle_loop(self, *args, acting=()):
        """The SPMD step of ``args`` with every tick's action the no-op branch (except on
        the ranks ``acting``), as a zero-argument callable that runs it once and waits
        (``pipeline_host.idle_loop_program``: what the program does beside its stage
        actions, or beside those ranks' actions)."""
        c, leaves, _ = self._compile(args)
        return self._idle_loop(c, leaves, acting)

    def _idle_loop(self, c, leaves, acting=()):
        from .pipeline_host import idle_loop_program
        sources, desc, rep, batch = self._inputs(c, leaves)

        def run(idle_prog):
            fn = idle_prog.build(len(sources), desc)
            return lambda: jax.block_until_ready(fn(sources, rep, batch))
        return idle_loop_program(c.prog, run, acting)

    def lower_text(self, *args) -> str:
        """The compiled HLO of the pipelined program (for the per-rank checks)."""
        c, leaves, mask = self._compile(args)
        sources, desc, rep, batch = self._inputs(c, leaves)
        return self._fn(c, sources, desc).lower(sources, rep, batch).compile().as_text()

    def compiled(self, *args):
        c, leaves, mask = self._compile(args)
        sources, desc, rep, batch = self._inputs(c, leaves)
        return self._fn(c, sources, desc).lower(sources, rep, batch).compile()
