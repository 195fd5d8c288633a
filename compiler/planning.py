"""Plan a training step for devices that are not here (issue 28): ``plan_step`` and
``shardprop plan``.

``plan_step(fn, args, mesh=..., cost_model=sp.Cluster(...))`` plans ``fn`` on ``mesh``
(a ``jax.sharding.AbstractMesh`` or ``(shape, names)`` as large as the cluster) from
``args`` given as ``jax.ShapeDtypeStruct``s (arrays work too; nothing is allocated)
and returns a ``PlanEstimate``: per device, the bytes of parameters, gradients,
optimizer state, activations and the modeled peak; the bytes each device sends per
step on each link class (inside a node, across nodes); the modeled step time,
tokens/s, TFLOP/s per device and MFU. It prints as a table and writes the report.

What it counts, and how:

- parameters and optimizer state: the local bytes of the arguments ``param_argnums``
  and ``optimizer_argnums`` under the plan's layouts, in their own dtypes (bf16
  weights with fp32 master copies in the optimizer state count as written);
- gradients: one per parameter leaf, laid out like it (the gradient of a weight is
  split as the weight is), in the parameter's dtype;
- peak: the largest, over the planned program's points, of the local bytes alive
  (arguments and outputs for the whole step, params and optimizer state donated so
  the new ones overwrite the old; every other value from its maker to its last
  reader), as ``passes/auto/memory.py`` counts it; activations: the peak less the
  parameters, gradients, optimizer state and other arguments, so the five add up to
  the peak (saved activations and temporaries alive there; gradients are taken as
  all alive at the peak, as they are when the update follows the whole backward).
  A loop's body is counted by its results only;
- flops: the traced program's, so activation recomputation (``jax.checkpoint``,
  inlined by the import) is counted as the devices execute it; TFLOP/s per device is
  those flops over the devices and the modeled step time, MFU that over the cost
  model's dense peak;
- step time: ``passes.cost.modeled_step_time`` (compute and communication, not
  overlapped).

A mesh with a ``pp`` axis (or ``pipeline=sp.Pipeline(...)``) plans pipeline stages
(``plan_pipelined``, below): one replica's step is planned on the stage's own mesh, cut
into layers priced one by one (``stage_layers``), and ``passes/pipeline/search.py``
chooses the cuts, micro-batches and schedule (with ``mode="auto"`` the mesh shape too);
memory per device is the fullest stage's state and the activations its schedule keeps in
flight, the step the schedule simulator's makespan with pp's exchanges on the cluster's
links, then dp's gradient all-reduce and the update.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import jax

from ..ir.errors import ShardingError
from ..ir.graph import is_collective
from ..passes.auto.memory import live_intervals
from ..passes.cost import modeled_step_time, resolve_cost_model
from ..passes.pipeline.cuts import CUT_WINDOWS, STAGE_WINDOWS, cut_windows

GiB = 2 ** 30


@dataclass
class PlanEstimate:
    """What ``plan_step`` found: bytes per device, bytes per link class, modeled times."""
    plan: Any
    mesh: dict                    # axis -> size
    cost_name: str
    devices: int
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    other_input_bytes: float
    activation_bytes: float
    peak_bytes: float
    capacity_bytes: Optional[float]
    link_bytes: dict              # link class -> bytes each device sends per step
    compute_s: float
    communication_s: float
    step_s: float
    flops: float                  # the step's, all devices together
    peak_flops_per_s: float
    tokens: Optional[int] = None  # per step
    planning_s: float = 0.0
    report_path: Optional[str] = None
    extra: dict = field(default_factory=dict)

    @property
    def tflops_per_device(self) -> float:
        return self.flops / self.devices / self.step_s / 1e12 if self.step_s else 0.0

    @property
    def mfu(self) -> float:
        return self.tflops_per_device * 1e12 / self.peak_flops_per_s if self.peak_flops_per_s else 0.0

    @property
    def tokens_per_s(self) -> Optional[float]:
        return self.tokens / self.step_s if self.tokens and self.step_s else None

    def as_dict(self) -> dict:
        return {"mesh": self.mesh, "cost_model": self.cost_name, "devices": self.devices,
                "memory_per_device_bytes": {"parameters": self.param_bytes, "gradients": self.grad_bytes,
                                            "optimizer_state": self.optimizer_bytes,
                                            "other_inputs": self.other_input_bytes,
                                            "activations": self.activation_bytes, "peak": self.peak_bytes,
                                            "capacity": self.capacity_bytes},
                "bytes_per_device_per_step": dict(self.link_bytes),
                "step_s": self.step_s, "compute_s": self.compute_s, "communication_s": self.communication_s,
                "tokens_per_s": self.tokens_per_s, "tflops_per_device": self.tflops_per_device, "mfu": self.mfu,
                "planning_s": self.planning_s,
                **({"pipeline": {k: v for k, v in self.extra["pipeline"].items() if k not in ("search", "stage_costs")}}
                   if "pipeline" in self.extra else {})}

    def __str__(self) -> str:
        def gib(b):
            return f"{b / GiB:10.2f} GiB"
        mesh = " x ".join(f"{a}={n}" for a, n in self.mesh.items())
        lines = [f"plan for mesh {mesh} ({self.devices} devices) priced by {self.cost_name}; "
                 f"planned in {self.planning_s:.1f} s",
                 "memory per device:",
                 f"  parameters       {gib(self.param_bytes)}",
                 f"  gradients        {gib(self.grad_bytes)}",
                 f"  optimizer state  {gib(self.optimizer_bytes)}",
                 f"  other inputs     {gib(self.other_input_bytes)}",
                 f"  activations      {gib(self.activation_bytes)}   " + (
                     "(of the micro-batches in flight)" if "pipeline" in self.extra else
                     "(and temporaries, at the peak)"),
                 f"  peak             {gib(self.peak_bytes)}" + (
                     f"   of {self.capacity_bytes / GiB:.0f} GiB: "
                     f"{'fits' if self.peak_bytes <= self.capacity_bytes else 'DOES NOT FIT'}"
                     if self.capacity_bytes else ""),
                 "bytes sent per device per step:"]
        for k, v in sorted(self.link_bytes.items()):
            lines.append(f"  {k:<16} {v / GiB:10.2f} GiB")
        pipe = self.extra.get("pipeline")
        if pipe:
            sched = pipe["schedule"] + (f" v={pipe['virtual_stages']}" if pipe["virtual_stages"] > 1 else "")
            lines += [f"pipeline         {pipe['pp']} stages x {pipe['microbatches']} micro-batches of "
                      f"{pipe['rows_per_microbatch']} rows, {sched}; {pipe['layers']} layers cut at "
                      f"{[a for a, _ in pipe['bounds'][1:]]}; bubble {pipe['bubble'] * 100:.1f} %",
                      f"modeled step     {self.step_s * 1e3:10.1f} ms (pipeline {pipe['pipeline_s'] * 1e3:.1f} ms, "
                      f"of which the busiest stage computes {self.compute_s * 1e3:.1f} ms; then gradient "
                      f"all-reduce and update {pipe['sync_s'] * 1e3:.1f} ms)"]
            if not pipe["fits"]:
                lines.append("                 (no configuration fits the memory limit: this is the fastest)")
        else:
            lines += [f"modeled step     {self.step_s * 1e3:10.1f} ms (compute {self.compute_s * 1e3:.1f} ms, "
                      f"communication {self.communication_s * 1e3:.1f} ms, not overlapped)"]
        if self.tokens_per_s:
            lines.append(f"tokens/s         {self.tokens_per_s:12,.0f}")
        lines += [f"TFLOP/s/device   {self.tflops_per_device:10.1f}",
                  f"MFU              {self.mfu * 100:10.1f} %   (of {self.peak_flops_per_s / 1e12:.0f} TFLOP/s dense peak)"]
        if self.report_path:
            lines.append(f"report           {self.report_path}")
        return "\n".join(lines)


def _link_class(cost, axes, mesh) -> str:
    f = getattr(cost, "link_class", None)
    return {"intra": "intra-node", "inter": "inter-node", "both": "both (hierarchical)"}[f(axes, mesh)] \
        if f is not None else "all links"


def _collectives(graph, times=1):
    for op in graph.ops:
        if is_collective(op) and op.kind != "slice":
            yield op, times
        for sub in op.subgraphs:
            yield from _collectives(sub, times * (op.params.get("length", 1) if op.kind == "scan" else 1))


def link_bytes(graph, cost) -> dict:
    """Bytes each device sends per step, by link class (``ClusterCost.link_class``; one
    class where the cost model knows no nodes); a loop's collectives once per iteration."""
    out: dict = {}
    mesh = graph.mesh
    for op, times in _collectives(graph):
        axes = tuple(op.params.get("axes") or mesh.axis_names)
        k = _link_class(cost, axes, mesh)
        out[k] = out.get(k, 0.0) + times * float(op.params.get("wire_bytes", 0))
    return out


def graph_flops(graph) -> float:
    """The step's flops, all devices together: each op's rule's (a loop's rule holds its body's)."""
    return float(sum(op.strategy.rule.flops for op in graph.ops
                     if not is_collective(op) and op.strategy is not None))


def peak_bytes(graph) -> float:
    """The modeled live peak per device of a planned (localized) graph."""
    import numpy as np
    intervals = live_intervals(graph)
    diff = np.zeros(len(graph.ops) + 3)
    for v, (b, d) in intervals.items():
        t = v.local_type or v.type
        diff[b + 1] += t.nbytes
        diff[d + 2] -= t.nbytes
    return float(np.cumsum(diff).max())


def plan_step(fn, args, *, mesh, cost_model=None, mode: str = "sharding_propagation", tokens: Optional[int] = None,
              param_argnums=(0,), optimizer_argnums=(1,), report: Optional[str] = None, pipeline=None,
              **parallelize_kwargs) -> PlanEstimate:
    """Plan ``fn(*args)`` on ``mesh`` without its devices and estimate what a step
    takes per device (module doc). ``args``: ``jax.ShapeDtypeStruct``s (or arrays);
    ``cost_model``: a ``Cluster``, a ``CostModel`` or a built-in name; ``tokens``:
    tokens per step (for tokens/s); ``report``: a path for the HTML report; the rest
    goes to ``parallelize``. Params and optimizer state are donated, as a training loop
    does. A mesh with a ``pp`` axis, or ``pipeline=sp.Pipeline(...)``, plans pipeline
    stages (``plan_pipelined``; ``batch_argnums=``, ``memory_limit=`` and
    ``search_options=`` go there)."""
    from ..runtime.mesh import resolve_mesh
    from .api import parallelize
    axis = getattr(pipeline, "axis", "pp")
    if pipeline is not None or axis in resolve_mesh(mesh).ir_mesh.axis_names:
        return plan_pipelined(fn, args, mesh=mesh, pipeline=pipeline, cost_model=cost_model, mode=mode,
                              tokens=tokens, param_argnums=param_argnums, optimizer_argnums=optimizer_argnums,
                              report=report, **parallelize_kwargs)
    args = tuple(args)
    donate = tuple(sorted(set(param_argnums) | set(optimizer_argnums)))
    t0 = time.perf_counter()
    pstep = parallelize(fn, mesh=mesh, mode=mode, cost_model=cost_model, donate_argnums=donate,
                        progress=parallelize_kwargs.pop("progress", False), **parallelize_kwargs)
    plan = pstep.plan(*args)
    planning_s = time.perf_counter() - t0
    graph = plan.graph
    cost = resolve_cost_model(cost_model, graph.mesh)

    counts = [len(jax.tree_util.tree_leaves(a)) for a in args]
    starts = [sum(counts[:i]) for i in range(len(args))]

    def arg_bytes(argnums) -> float:
        return float(sum((graph.inputs[j].local_type or graph.inputs[j].type).nbytes
                         for a in argnums if a < len(args) for j in range(starts[a], starts[a] + counts[a])))
    params, opt = arg_bytes(param_argnums), arg_bytes(optimizer_argnums)
    others = arg_bytes([a for a in range(len(args)) if a not in param_argnums and a not in optimizer_argnums])
    peak = peak_bytes(graph)
    times = modeled_step_time(graph, cost)
    est = PlanEstimate(plan=plan, mesh=dict(zip(graph.mesh.axis_names, graph.mesh.axis_sizes)),
                       cost_name=cost.name or "the default cost model", devices=graph.mesh.size,
                       param_bytes=params, grad_bytes=params, optimizer_bytes=opt, other_input_bytes=others,
                       activation_bytes=max(0.0, peak - 2 * params - opt - others), peak_bytes=peak,
                       capacity_bytes=cost.memory_capacity_bytes, link_bytes=link_bytes(graph, cost),
                       compute_s=times["compute"], communication_s=times["communication"], step_s=times["total"],
                       flops=graph_flops(graph), peak_flops_per_s=cost.flops_per_s, tokens=tokens,
                       planning_s=planning_s)
    if report:
        plan.to_html(report)
        est.report_path = str(report)
    return est


def load_step(spec: str):
    """``"script.py:make_step"`` -> what ``make_step()`` returns, checked: ``(fn, args)``
    or ``(fn, args, options)`` with options a dict of ``plan_step`` keywords (``tokens``,
    ``param_argnums``, ``optimizer_argnums``, ``mode``...)."""
    import importlib.util
    import os
    import sys
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ShardingError(f"{spec!r}: write SCRIPT.py:FUNCTION, e.g. model.py:make_step")
    if not os.path.exists(path):
        raise ShardingError(f"{spec!r}: no file {path}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    module_name = f"_shardprop_plan_{os.path.splitext(os.path.basename(path))[0]}"
    spec_ = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec_)
    sys.modules[module_name] = module
    spec_.loader.exec_module(module)
    make = getattr(module, name, None)
    if not callable(make):
        raise ShardingError(f"{spec!r}: {path} has no function {name!r}")
    out = make()
    if not (isinstance(out, tuple) and len(out) in (2, 3) and callable(out[0])
            and isinstance(out[1], (tuple, list))):
        raise ShardingError(f"{spec!r}: {name}() must return (step_fn, args) or (step_fn, args, options): "
                            f"args a tuple of jax.ShapeDtypeStruct pytrees, options a dict of plan_step keywords")
    return out[0], tuple(out[1]), dict(out[2]) if len(out) == 3 else {}


def parse_mesh(text: str):
    """``"16x64:dp,mp"`` -> ((16, 64), ("dp", "mp"))."""
    try:
        shape, names = text.split(":")
        sizes = tuple(int(x) for x in shape.lower().split("x"))
        axes = tuple(a.strip() for a in names.split(","))
    except ValueError:
        raise ShardingError(f"--mesh {text!r}: write SIZExSIZE:name,name, e.g. 16x64:dp,mp") from None
    if len(sizes) != len(axes) or math.prod(sizes) < 1:
        raise ShardingError(f"--mesh {text!r}: {len(sizes)} sizes but {len(axes)} names")
    return sizes, axes


# ---------------------------------------------------------------- pipeline stages
#
# A mesh with a pipeline axis (``pp``, or ``sp.Pipeline(axis=...)``) or ``pipeline=`` plans
# the step as pipeline stages without running it. One replica's step is planned by the
# compiler on the stage's own mesh (the tensor-parallel axes, the data axis at size 1) at a
# few rows; that planned program is cut into layers (op ranges between cheap cut points) and
# priced per layer (``stage_layers``); ``passes/pipeline/search.py`` then chooses the cuts,
# the micro-batch count and the schedule (and with ``mode="auto"`` the mesh shape), pricing
# pp's exchanges and dp's gradient all-reduce on the whole mesh's links.

STAGE_ROWS = 2     # rows per replica the stage is planned at (costs scale linearly from there)


@dataclass
class StageLayers:
    """A planned stage program cut into layers: the search's ``LayerCosts`` and, per
    layer, the bytes ``PlanEstimate`` reports (parameters, optimizer state)."""
    costs: Any                    # passes.pipeline.search.LayerCosts
    param_bytes: tuple
    optimizer_bytes: tuple
    other_input_bytes: float
    flops: float                  # the planned step's, all devices of the stage mesh together
    link_bytes: dict              # per micro-batch of ``costs.rows`` rows, per device
    plan: Any
    forward_ops: int
    layer_of: dict = field(default_factory=dict, repr=False)   # op -> its layer
    once_ops: frozenset = frozenset()                          # the update's ops
    layer_link_bytes: tuple = ()  # per layer, {link class: bytes each device sends}, per micro-batch


def _op_seconds(op, cost, mesh, resident) -> tuple:
    """(seconds, of which fixed) of one planned op: a collective's alpha-beta (its latency
    fixed), a computation's roofline (``passes.cost``)."""
    from ..passes.cost import compute_unit, is_contraction, strategy_work, tensor_factors
    if is_collective(op):
        if op.kind == "slice":
            return 0.0, 0.0
        axes = op.params.get("axes") or ()
        return (cost.collective_time(op.params.get("wire_bytes", 0), op.kind, axes, mesh),
                cost.collective_time(0, op.kind, axes, mesh))
    total = fixed = 0.0
    st = op.strategy
    if st is not None:
        total = cost.compute_time(*strategy_work(st.rule.flops, st.factors, tensor_factors(op, st.rule, resident),
                                                 mesh), contraction=is_contraction(st.rule),
                                  unit=compute_unit(op) if cost.prices_units else None)
    for sub in op.subgraphs:          # a loop's compute is in its rule; its collectives are in the body
        n = op.params.get("length", 1) if op.kind == "scan" else 1
        for inner in sub.ops:
            if is_collective(inner):
                t, f = _op_seconds(inner, cost, mesh, resident)
                total, fixed = total + n * t, fixed + n * f
    return total, fixed


def stage_layers(plan, cost, *, param_inputs: set, optimizer_inputs: set, rows: int,
                 windows: int = CUT_WINDOWS) -> StageLayers:
    """Cut one replica's planned step into layers and price each (see above):

    - the **forward** is every op the loss (each float scalar output) is computed from,
      in program order; a cut after forward op ``n`` carries the forward values made up
      to ``n`` from the batch and read after it (what a parameter alone makes, e.g. a
      weight's cast, is made again by its reader's stage); the cheap cut points
      (``passes/pipeline/cuts.py``'s ``cut_windows``) bound the layers;
    - an op reading the optimizer state (or made from one that does) is the **update**
      (once per step); every other op is the **backward** (once per micro-batch). A
      backward op belongs to the layer of the latest forward value made from the
      parameters it reads (a one-hot of the targets or a mask locates nothing), else to the
      earliest layer of the values it reads (a gradient flowing down); a forward value's
      layer is its first forward reader's (a recomputed layer's backward reads its input
      and runs with the layer); an update op runs on the layer of the parameter it
      writes (found from its readers back to the op that reads the parameter);
    - a parameter belongs to the layer of its first forward reader, an optimizer-state
      leaf to the layer of its first reader; **activations** are the forward values a
      backward op reads (what a micro-batch keeps until its backward), local sizes."""
    from ..passes.cost import collective_models
    from ..passes.fusion import resident_values
    from ..passes.pipeline.search import LayerCosts
    graph = plan.graph
    mesh = graph.mesh
    producer = graph.producers()
    loss = [v for v in graph.outputs if math.prod(v.type.shape) == 1 and "float" in str(v.type.dtype)
            and v in producer]
    if not loss:
        raise ShardingError("planning pipeline stages: the step returns no loss (a float scalar output), so its "
                            "forward cannot be told from its backward; return the loss from the step")
    forward, stack = set(), [producer[v] for v in loss]
    while stack:
        op = stack.pop()
        if op in forward:
            continue
        forward.add(op)
        stack.extend(producer[v] for v in op.inputs if v in producer)
    fops = [op for op in graph.ops if op in forward]
    pos = {op: n for n, op in enumerate(fops)}
    F = len(fops)

    def nbytes(v) -> float:
        return float((v.local_type or v.type).nbytes)

    # bytes crossing the cut after forward op n: the values made from the batch (a value made
    # from parameters alone, such as a weight's cast, is made again where it is read)
    users = graph.users()
    state = {graph.inputs[i] for i in param_inputs | optimizer_inputs}
    from_batch = {v for v in graph.inputs if v not in state}
    for op in graph.ops:
        if any(v in from_batch for v in op.inputs):
            from_batch.update(op.outputs)
    diff = [0.0] * (F + 1)
    for op in fops:
        for v in op.outputs:
            if v not in from_batch:
                continue
            later = [pos[u] for u in users.get(v, ()) if u in pos]
            if later and max(later) > pos[op]:
                diff[pos[op]] += nbytes(v)
                diff[max(later)] -= nbytes(v)
    crossing, acc = [], 0.0
    for n in range(F - 1):
        acc += diff[n]
        crossing.append(acc)
    resident = resident_values(graph, cost.kernels)
    # priced as passes.cost.modeled_step_time prices the whole step (``collective_models``)
    models, riders = collective_models(graph, cost)
    seconds = {op: _op_seconds(op, models.get(op, cost), mesh, resident) for op in graph.ops}
    for op in riders:
        t, fixed = seconds[op]
        seconds[op] = (t - fixed, 0.0)
    cuts = cut_windows(crossing, [seconds[op][0] for op in fops], windows)
    starts = [0] + [n + 1 for n in cuts]
    unit_of_pos = []
    for u, (a, b) in enumerate(zip(starts, starts[1:] + [F])):
        unit_of_pos += [u] * (b - a)
    L = len(starts)

    opt_values = {graph.inputs[i] for i in optimizer_inputs}
    inputs = {v: i for i, v in enumerate(graph.inputs)}
    first_reader = {}
    for op in fops:
        for v in op.inputs:
            first_reader.setdefault(v, unit_of_pos[pos[op]])
    # where each op runs: forward ops by position; then in program order (None: an op made
    # from constants alone, such as a cotangent's seed, says nothing; an update op reading no
    # parameter waits); then what is left from its readers, in reverse (an optimizer's
    # moments take the layer of the parameter their update writes)
    # values made from the parameters (the activations' chain); a value made from the batch and
    # constants alone (a one-hot of the targets, a mask) says nothing of where its readers run
    params_in = {graph.inputs[i] for i in param_inputs}
    from_params = set(params_in)
    for op in graph.ops:
        if any(v in from_params for v in op.inputs):
            from_params.update(op.outputs)
    unit, once = {}, set()
    home = {}     # a forward value's layer: its first forward reader's (where the forward used it)
    for op in fops:
        unit[op] = unit_of_pos[pos[op]]
        for v in op.inputs:
            if producer.get(v) in pos:
                home[v] = min(home.get(v, unit[op]), unit[op])
    for op in graph.ops:
        if op in pos:
            continue
        if any(v in opt_values or producer.get(v) in once for v in op.inputs):
            once.add(op)       # the update: on the layer of the parameter it writes (filled in below)
            par = [first_reader[v] for v in op.inputs if v in first_reader and inputs.get(v) in param_inputs]
            unit[op] = min(par) if par else None
            continue
        fwd_in = [home.get(v, unit[producer[v]]) for v in op.inputs if producer.get(v) in pos and v in from_params]
        rest = [unit[producer[v]] for v in op.inputs if producer.get(v) in unit and unit[producer[v]] is not None]
        par = [first_reader[v] for v in op.inputs if v in first_reader]
        unit[op] = max(fwd_in) if fwd_in else min(rest) if rest else min(par) if par else None
    for op in reversed(graph.ops):
        if unit[op] is None:
            later = [unit[u] for v in op.outputs for u in users.get(v, ()) if unit.get(u) is not None]
            unit[op] = min(later) if later else L - 1
    fwd_s, bwd_s, upd_s = [0.0] * L, [0.0] * L, [0.0] * L
    fwd_fix, bwd_fix = [0.0] * L, [0.0] * L
    act = [0.0] * L
    counted_act = set()
    sent = [dict() for _ in range(L)]
    for op in graph.ops:
        t, fixed = seconds[op]
        u = unit[op]
        if is_collective(op) and op.kind != "slice":
            k = _link_class(cost, tuple(op.params.get("axes") or mesh.axis_names), mesh)
            sent[u][k] = sent[u].get(k, 0.0) + float(op.params.get("wire_bytes", 0))
        if op in pos:
            fwd_s[u] += t
            fwd_fix[u] += fixed
        elif op in once:
            upd_s[u] += t
        else:
            bwd_s[u] += t
            bwd_fix[u] += fixed
            for v in op.inputs:
                if producer.get(v) in pos and v not in counted_act:
                    counted_act.add(v)
                    act[home.get(v, unit[producer[v]])] += nbytes(v)
        for v in op.inputs:
            first_reader.setdefault(v, u)
    param_b, opt_b, others = [0.0] * L, [0.0] * L, 0.0
    for i, v in enumerate(graph.inputs):
        if i in param_inputs:
            param_b[first_reader.get(v, 0)] += nbytes(v)
        elif i in optimizer_inputs:
            opt_b[first_reader.get(v, 0)] += nbytes(v)
        else:
            others += nbytes(v)
    grads = tuple(param_b)        # one gradient per parameter, laid out like it
    costs = LayerCosts(forward_s=fwd_s, backward_s=bwd_s, state_bytes=[2 * p + o for p, o in zip(param_b, opt_b)],
                       activation_bytes=act, exchange_bytes=[crossing[n] for n in cuts], grad_bytes=grads,
                       update_s=upd_s, forward_fixed_s=fwd_fix, backward_fixed_s=bwd_fix, rows=rows)
    return StageLayers(costs, tuple(param_b), tuple(opt_b), others, graph_flops(graph), link_bytes(graph, cost), plan,
                       F, unit, frozenset(once), tuple(sent))


def _pipeline_axes(names, sizes, axis: str):
    """(pp axis, data axis or None, tensor axes) of a mesh with a pipeline axis."""
    if axis not in names:
        raise ShardingError(f"planning pipeline stages: the mesh {dict(zip(names, sizes))} has no pipeline axis "
                            f"{axis!r}; name one, e.g. mesh=((8, 8, 16), ('pp', 'dp', 'mp'))")
    rest = [a for a in names if a != axis]
    data = "dp" if "dp" in rest else None
    return axis, data, [a for a in rest if a != data]


def plan_pipelined(fn, args, *, mesh, pipeline=None, cost_model=None, mode: str = "sharding_propagation",
                   tokens: Optional[int] = None, param_argnums=(0,), optimizer_argnums=(1,), batch_argnums=None,
                   memory_limit=None, report: Optional[str] = None, search_options: Optional[dict] = None,
                   **parallelize_kwargs) -> PlanEstimate:
    """``plan_step`` for a mesh with a pipeline axis (or ``pipeline=``): see above. With
    ``mode="auto"`` the mesh's shape is searched too (pp x dp x tp over its devices, the
    tensor-parallel degree among the divisors of a node's GPUs and the mesh's own);
    ``Pipeline(microbatches="auto")`` / ``schedule="auto"`` (the default when only the mesh
    names a pp axis) search those. ``search_options``: keywords for ``search_pipeline``
    that override these (``pp=None, dp=None, tp=[1, 2, 4, 8]`` searches the shape with
    the marks too; ``finalists``, ``max_microbatches``)."""
    from dataclasses import replace

    from jax.sharding import AbstractMesh

    from ..ir.mesh import Mesh
    from ..passes.auto.memory import parse_memory_limit
    from ..passes.pipeline.search import search_pipeline
    from ..runtime.mesh import resolve_mesh
    from .api import parallelize
    from .stages import Pipeline
    t0 = time.perf_counter()
    if pipeline is None:
        pipeline = Pipeline(microbatches="auto", schedule="auto")
    if not isinstance(pipeline, Pipeline):
        raise ShardingError(f"pipeline={pipeline!r}: pass sp.Pipeline(microbatches=..., schedule=...)")
    for key in ("shard_params", "shard_optimizer_state"):
        if parallelize_kwargs.get(key):
            raise ShardingError(f"planning pipeline stages does not take {key}=True yet: the stages' state is "
                                f"priced unsplit over dp; drop {key}, or plan without a pp axis")
    ir_mesh = resolve_mesh(mesh).ir_mesh
    names, sizes = tuple(ir_mesh.axis_names), tuple(ir_mesh.axis_sizes)
    pp_axis, dp_axis, tp_axes = _pipeline_axes(names, sizes, pipeline.axis)
    if len(tp_axes) > 1:
        raise ShardingError(f"planning pipeline stages: the mesh {dict(zip(names, sizes))} has tensor axes "
                            f"{tp_axes}; name one tensor-parallel axis beside {pp_axis!r} and the data axis 'dp'")
    tp_axis = tp_axes[0] if tp_axes else "mp"
    size = dict(zip(names, sizes))
    devices = ir_mesh.size
    cost3 = resolve_cost_model(cost_model, ir_mesh)

    args = tuple(args)
    counts = [len(jax.tree_util.tree_leaves(a)) for a in args]
    starts = [sum(counts[:i]) for i in range(len(args))]
    leaves = lambda nums: {j for a in nums if a < len(args) for j in range(starts[a], starts[a] + counts[a])}
    if batch_argnums is None:
        batch_argnums = tuple(a for a in range(len(args)) if a not in param_argnums and a not in optimizer_argnums)
    batch_argnums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    dims = {tuple(x.shape)[0] for a in batch_argnums for x in jax.tree_util.tree_leaves(args[a]) if x.shape}
    if len(dims) != 1:
        raise ShardingError(f"planning pipeline stages: the batch arguments {batch_argnums} must share their dim 0 "
                            f"(the batch), got {sorted(dims)}; pass batch_argnums=")
    batch = dims.pop()

    def at_rows(r):
        return tuple(jax.tree.map(lambda x: jax.ShapeDtypeStruct((r,) + tuple(x.shape[1:]), x.dtype), a)
                     if i in batch_argnums else a for i, a in enumerate(args))

    search_auto_shape = mode == "auto"
    fixed_m = pipeline.microbatches if pipeline.microbatches != "auto" else None
    rows = STAGE_ROWS
    if not search_auto_shape and fixed_m and batch % (fixed_m * size.get(dp_axis, 1)) == 0:
        rows = max(rows, batch // (fixed_m * size.get(dp_axis, 1)))
    donate = tuple(sorted(set(param_argnums) | set(optimizer_argnums)))
    # a given pp gets at least STAGE_WINDOWS cut windows per stage x chunk, so that many stages
    # can still be balanced to a fraction of a stage's time
    windows = CUT_WINDOWS if search_auto_shape else max(CUT_WINDOWS, STAGE_WINDOWS * size[pp_axis] *
                                                        pipeline.virtual_stages)
    memo: dict = {}

    def stage(tp: int) -> StageLayers:
        if tp not in memo:
            stage_names = ((dp_axis,) if dp_axis else ()) + (tp_axis,)
            stage_sizes = ((1,) if dp_axis else ()) + (tp,)
            # abstract, so no compiled memory check; and no memory limit: one replica's step at a
            # few rows is priced here, its memory is the pipeline search's (parallelize gives
            # mode="auto" a Cluster's GPU memory as its limit, and the search's rounds under a
            # limit cost many times a plain search)
            uncapped = resolve_cost_model(cost_model, Mesh(stage_names, stage_sizes)).with_memory_capacity(None)
            pstep = parallelize(fn, mesh=AbstractMesh(stage_sizes, stage_names), mode=mode, cost_model=uncapped,
                                donate_argnums=donate, progress=parallelize_kwargs.get("progress", False),
                                **{k: v for k, v in parallelize_kwargs.items() if k != "progress"})
            pstep.options = replace(pstep.options, memory_limit=None)
            plan = pstep.plan(*at_rows(rows))
            memo[tp] = stage_layers(plan, uncapped, param_inputs=leaves(param_argnums),
                                    optimizer_inputs=leaves(optimizer_argnums), rows=rows, windows=windows)
        return memo[tp]

    if search_auto_shape:
        per_node = getattr(getattr(cost3, "cluster", None), "gpus_per_node", None) or devices
        tps = sorted({t for t in range(1, per_node + 1) if per_node % t == 0 and devices % t == 0}
                     | ({size[tp_axis]} if tp_axis in size else set()))
        shape = dict(pp=None, dp=None, tp=tps)
    else:
        shape = dict(pp=size[pp_axis], dp=size.get(dp_axis, 1), tp=size.get(tp_axis, 1))
    limit = parse_memory_limit(memory_limit) if memory_limit is not None else cost3.memory_capacity_bytes
    schedules = ("interleaved",) if pipeline.virtual_stages > 1 else \
        ("gpipe", "1f1b", "zero_bubble", "interleaved") if pipeline.schedule == "auto" else (pipeline.schedule,)
    options = dict(microbatches=fixed_m, schedules=schedules,
                   virtual_stages=(pipeline.virtual_stages,) if pipeline.virtual_stages > 1 else (2,),
                   axis_names=(pp_axis, dp_axis or "dp", tp_axis), **shape)
    options.update(search_options or {})     # e.g. pp=None, dp=None, tp=[...]: search the shape with marks

    def costs(tp):
        return stage(tp).costs
    fits = True
    try:
        found = search_pipeline(costs, devices, batch, cost3, memory_limit=limit, **options)
    except ShardingError as e:
        if "no configuration fits" not in str(e):
            raise
        found = search_pipeline(costs, devices, batch, cost3, memory_limit=None, **options)
        fits = False
    best = found.best
    st = stage(best.tp)
    chosen = Mesh((pp_axis, dp_axis or "dp", tp_axis), (best.pp, best.dp, best.tp))
    est = _pipeline_estimate(st, best, found, chosen, cost3, batch, tokens, limit, fits)
    est.planning_s = time.perf_counter() - t0
    est.extra["pipeline"]["stage_costs"] = {t: memo[t].costs for t in memo if isinstance(memo[t], StageLayers)}
    if report:
        st.plan.to_html(report)
        est.report_path = str(report)
    return est


def _pipeline_estimate(st: StageLayers, best, found, mesh, cost, batch: int, tokens, capacity, fits) -> PlanEstimate:
    """What one device of the chosen pipeline holds and sends, and the step's figures."""
    cuts, p, m = best.cuts, best.pp, best.microbatches
    rows = batch // (best.dp * m)
    fwd, bwd, act, ex = st.costs.at_rows(rows)
    ranks = []
    for d in range(p):
        mine = [(k, a, b) for k, (a, b) in enumerate(cuts.bounds) if k % p == d]
        params = sum(sum(st.param_bytes[a:b]) for _, a, b in mine)
        ranks.append(dict(rank=d, layers=[(a, b) for _, a, b in mine], parameters=params, gradients=params,
                          optimizer_state=sum(sum(st.optimizer_bytes[a:b]) for _, a, b in mine),
                          activations=sum(cuts.in_flight[k] * sum(act[a:b]) for k, a, b in mine)))
    for r in ranks:
        r["peak"] = r["parameters"] + r["gradients"] + r["optimizer_state"] + r["activations"] + st.other_input_bytes
    fullest = max(ranks, key=lambda r: r["peak"])
    links = {}

    def add(axes, nbytes):
        if nbytes > 0:
            k = _link_class(cost, axes, mesh)
            links[k] = links.get(k, 0.0) + nbytes
    pp_axis, dp_axis, tp_axis = mesh.axis_names
    if p > 1:   # its stages send each micro-batch's activations on and their input's gradient back
        add((pp_axis,), m * sum((ex[a - 1] if a > 0 else 0.0) + (ex[b - 1] if b < len(fwd) else 0.0)
                                for a, b in fullest["layers"]))
    from ..passes.cost import wire_bytes
    add((dp_axis,), wire_bytes("all_reduce", fullest["gradients"], best.dp))
    for a, b in fullest["layers"]:         # tp's collectives of its layers, per micro-batch, scaled to its rows
        for i in range(a, b):
            for k, v in st.layer_link_bytes[i].items():
                links[k] = links.get(k, 0.0) + v * m * rows / st.costs.rows
    busy = sum(cuts.stage_times) * m / best.virtual_stages
    bubble = max(0.0, 1.0 - busy / (p * best.pipeline_s)) if p > 1 and best.pipeline_s else 0.0
    compute = m * max(sum(fwd[i] + bwd[i] for a, b in r["layers"] for i in range(a, b)) for r in ranks)
    info = dict(pp=p, dp=best.dp, tp=best.tp, microbatches=m, schedule=best.schedule,
                virtual_stages=best.virtual_stages, rows_per_microbatch=rows, bounds=cuts.bounds,
                layers=st.costs.layers, bubble=bubble, pipeline_s=best.pipeline_s, sync_s=best.sync_s,
                ranks=ranks, fits=fits, search=found)
    return PlanEstimate(plan=st.plan, mesh=dict(zip(mesh.axis_names, mesh.axis_sizes)),
                        cost_name=cost.name or "the default cost model", devices=mesh.size,
                        param_bytes=fullest["parameters"], grad_bytes=fullest["gradients"],
                        optimizer_bytes=fullest["optimizer_state"], other_input_bytes=st.other_input_bytes,
                        activation_bytes=fullest["activations"], peak_bytes=fullest["peak"],
                        capacity_bytes=capacity, link_bytes=links, compute_s=min(compute, best.step_s),
                        communication_s=max(0.0, best.step_s - compute), step_s=best.step_s,
                        flops=st.flops * batch / st.costs.rows, peak_flops_per_s=cost.flops_per_s, tokens=tokens,
                        extra={"pipeline": info})
