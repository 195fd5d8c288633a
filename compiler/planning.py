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

The mesh may name a ``pp`` axis once pipeline stages plan through ``parallelize``;
``plan_step`` takes the mesh and the cost model as they are and has no pp of its own.
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
                "planning_s": self.planning_s}

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
                 f"  activations      {gib(self.activation_bytes)}   (and temporaries, at the peak)",
                 f"  peak             {gib(self.peak_bytes)}" + (
                     f"   of {self.capacity_bytes / GiB:.0f} GiB: "
                     f"{'fits' if self.peak_bytes <= self.capacity_bytes else 'DOES NOT FIT'}"
                     if self.capacity_bytes else ""),
                 "bytes sent per device per step:"]
        for k, v in sorted(self.link_bytes.items()):
            lines.append(f"  {k:<16} {v / GiB:10.2f} GiB")
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
              param_argnums=(0,), optimizer_argnums=(1,), report: Optional[str] = None, **parallelize_kwargs
              ) -> PlanEstimate:
    """Plan ``fn(*args)`` on ``mesh`` without its devices and estimate what a step
    takes per device (module doc). ``args``: ``jax.ShapeDtypeStruct``s (or arrays);
    ``cost_model``: a ``Cluster``, a ``CostModel`` or a built-in name; ``tokens``:
    tokens per step (for tokens/s); ``report``: a path for the HTML report; the rest
    goes to ``parallelize``. Params and optimizer state are donated, as a training loop
    does."""
    from .api import parallelize
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
