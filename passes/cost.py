"""What a step costs: time on the wire plus time computing, and memory per device.

Counting only bytes is a trap (see DESIGN.md): a plan that gathers an activation
and repeats a matmul on every rank moves fewer bytes than Megatron's, yet is
slower. So communication and compute are both priced in seconds:

- a collective costs a latency plus its wire bytes over a bandwidth (alpha-beta),
  per group of devices it runs over and, where a calibration found them to differ,
  per collective kind (``links``);
- an op costs the larger of its flops over the matmul rate and the bytes it touches
  on one device over the memory (elementwise) rate: a roofline. The bytes are each
  operand's and result's *local* size under the strategy: a tensor the strategy leaves
  whole (a weight beside a split batch, an activation beside split weights) is read
  whole on every device;
- where a profile measured it (``contraction_bytes_per_s``), a contraction (matmul,
  convolution) costs its flops over the matmul rate *plus* its local bytes over that
  rate: the operands are streamed (packed) apart from the arithmetic, which is why a
  skinny per-device matmul (few rows against a whole weight) runs below the square
  matmul's rate;
- where a profile measured it (``waits`` per group, ``sync_s`` for all devices), a move
  also costs the wait for every device of its group to arrive from the compute before it:
  back-to-back collectives (what the per-group fits time, and a move's later steps) arrive
  together, a collective between compute phases waits for the slowest device (on devices
  that share cores, for the scheduler), the sooner the fewer devices it spans;
- ``memory_capacity_bytes`` is what one device holds (None: unlimited).

A calibrated profile's compute rates are per device with all its devices busy at once.
Where forced CPU devices share a host's cores that is not one device's rate alone, so
``shardprop calibrate`` also measures the rates of one device alone (``alone``) and what
the driver of a Python-dispatched step pays per program and per transfer
(``dispatch_s``, ``transfer_s``), and how many devices' work the host gets done with 1, 2,
4, ... of them busy at once (``at_once``); the pipeline's host model reads them
(``compiler/pipeline_step.py``). The search does not.

The defaults describe one modern GPU node with no per-group terms; only their
ratios steer decisions, and the golden dumps are planned with them. A measured
profile (``shardprop calibrate``) or a built-in one (``CostModel.builtin``) adds
the per-group terms. A group is named by its rank geometry (``group_shape``), not
by axis names, so a profile measured on ``mesh=8`` prices any mesh of those 8
devices: a 2x4 mesh's axis of 4 is the same ranks as the 8-mesh's two minor axes.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

from ..ir.errors import ShardingError

SCHEMA = "shardprop.cost/1"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute")
PROFILES = Path(__file__).resolve().parent / "profiles"   # built-in profiles (package data)

Group = tuple   # ((size, stride), ...): runs of ranks a collective's groups span, minor first


def group_shape(axes, mesh) -> Group:
    """The rank geometry of one collective group over ``axes`` of ``mesh``: a (size,
    stride) per run of axes, ranks laid out row-major, contiguous runs merged. Axes
    of size 1 take no part. Two collectives with the same geometry run over the same
    kind of device groups whatever the axes are called."""
    stride, strides = 1, {}
    for name, size in reversed(list(zip(mesh.axis_names, mesh.axis_sizes))):
        strides[name] = stride
        stride *= size
    pieces = sorted((mesh.axis_size(a), strides[a]) for a in set(axes) if mesh.axis_size(a) > 1)
    pieces.sort(key=lambda p: p[1])
    merged: list[tuple[int, int]] = []
    for size, st in pieces:
        if merged and merged[-1][1] * merged[-1][0] == st:
            merged[-1] = (merged[-1][0] * size, merged[-1][1])
        else:
            merged.append((size, st))
    return tuple(merged)


@dataclass(frozen=True)
class Link:
    """Alpha-beta: one collective takes ``latency_s + wire_bytes / bytes_per_s``."""
    latency_s: float
    bytes_per_s: float

    def time(self, wire_bytes: float) -> float:
        return self.latency_s + wire_bytes / self.bytes_per_s


IMPOSSIBLE = 1e6   # seconds: the price of a redistribution that cannot exist (nothing makes a partial value)


@dataclass(frozen=True)
class ComputeRates:
    """One device's compute rates (``CostModel``'s three, under other conditions)."""
    flops_per_s: float
    memory_bytes_per_s: float
    contraction_bytes_per_s: Optional[float] = None


@dataclass(frozen=True)
class CostModel:
    latency_s: float = 5e-6          # fixed cost of one collective (where no link says otherwise)
    link_bytes_per_s: float = 100e9  # per-device collective bandwidth (likewise)
    flops_per_s: float = 200e12      # dense matmul throughput per device
    memory_bytes_per_s: float = 2e12  # memory bandwidth per device: elementwise and memory-bound ops
    # a contraction's operand streaming, not overlapped with its flops (None: the plain roofline)
    contraction_bytes_per_s: Optional[float] = None
    sync_s: float = 0.0              # a collective's wait for its group after compute (profiles only)
    # that wait measured per device group (calibrate): ((group, seconds), ...). Where set, a
    # group's own replaces ``sync_s`` (a group not measured as a whole waits as its slowest
    # measured axis): the fewer devices, the sooner the last of them arrives
    waits: tuple = ()
    # the part of its wait one collective pays: 1/n where n collectives follow one wait
    # (``at_step_end``, ``with_sync_share``); 0 for a collective that follows another back to
    # back (``back_to_back``)
    wait_share: float = 1.0
    memory_capacity_bytes: Optional[int] = None   # per device; None: unlimited
    # per-group alpha-beta: ((group, kind, Link), ...); kind "" holds for every kind
    links: tuple = ()
    device_count: Optional[int] = None   # the devices it was measured on; None: any count
    mesh_shape: tuple = ()               # the mesh it was measured on (for the record)
    mesh_axes: tuple = ()
    device_kind: str = ""
    name: str = ""
    notes: str = field(default="", compare=False)
    # the collective kinds the compiler combines into one launch when they do not depend on
    # each other (XLA's combiners: all three on GPUs; on CPUs, measured by calibrate, only
    # all_reduce)
    combined_kinds: tuple = ("all_reduce", "reduce_scatter", "all_gather")
    # the share of its launch a collective of those kinds pays: 1/n where n ride one launch
    # (``at_step_end(n)``); not a profile's
    launch_share: float = 1.0
    # the rates of one device computing alone, where the rates above were measured with
    # every device busy at once (calibrate; None: not measured, see
    # pipeline_step.calibration_contention)
    alone: Optional[ComputeRates] = None
    # a Python driver's cost to dispatch one jitted program, and one jax.device_put to
    # another device, without waiting for either (calibrate; None: not measured)
    dispatch_s: Optional[float] = None
    transfer_s: Optional[float] = None
    # ((devices busy, devices' work alone they get done at once), ...) with 1, 2, 4, ... of
    # the devices running the same matmuls (calibrate; (): not measured)
    at_once: tuple = ()
    # (("contraction", cores), ("memory", cores), ("at_once", cores)): how many cores one
    # device's matmuls, fused loops and at_once's matmul kept busy alone, CPU seconds over
    # wall seconds (calibrate; (): not measured, ranks are counted, not their cores)
    cores_alone: tuple = ()
    # which traced ops one kernel runs (passes/fusion.py KernelPolicy): "xla" (XLA's fusion),
    # "unfused", or a framework's, e.g. "megatron-2021"; what reaches memory is priced
    kernels: str = "xla"
    # whether ``compute_time`` reads each op's ``compute_unit`` (a cluster's GPU model does;
    # this model prices every op on one roofline)
    prices_units = False

    # A calibrated model has dozens of links and is a cache key on hot paths:
    # hash it once.
    def __hash__(self):
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.latency_s, self.link_bytes_per_s, self.flops_per_s, self.memory_bytes_per_s,
                     self.contraction_bytes_per_s, self.sync_s, self.waits, self.wait_share, self.memory_capacity_bytes,
                     self.links, self.device_count,
                     self.device_kind, self.name, self.combined_kinds, self.launch_share, self.alone,
                     self.dispatch_s, self.transfer_s, self.at_once, self.cores_alone, self.kernels))

    def __post_init__(self):
        from .fusion import builtin_policy
        builtin_policy(self.kernels)   # an unknown name: a ShardingError naming the known ones

    # -- time ----------------------------------------------------------------
    def collective_time(self, wire_bytes: float, kind: Optional[str] = None, axes=None, mesh=None) -> float:
        """Seconds for one collective moving ``wire_bytes`` per device. Given its kind,
        mesh axes and mesh, a profile's per-group terms apply; without them (or in a
        model without links) the model's single latency and bandwidth do."""
        if self.links and axes and mesh is not None:
            link = self.link(kind or "", tuple(axes), mesh)
            latency, bytes_per_s, wait = link.latency_s, link.bytes_per_s, self.wait(tuple(axes), mesh)
        else:
            latency, bytes_per_s, wait = self.latency_s, self.link_bytes_per_s, 0.0
        # at the step's end, a combined kind shares its launch (``at_step_end``)
        share = self.launch_share if kind in self.combined_kinds else 1.0
        return wait + (share * latency + wire_bytes / bytes_per_s)

    def at_step_end(self, riders: int) -> "CostModel":
        """This model for moving a value nothing computes on before the step ends (a
        terminal value: a gradient on its way to the update), one of ``riders`` such
        values. The group waits once for its last device there, not once per collective
        (after the first, the rest run back to back), and the compiler combines those of
        ``combined_kinds`` that do not depend on each other into one launch: each pays its
        bytes, 1/riders of the wait and, of a combined kind, 1/riders of the launch. One
        rider (a forward pass's partial output) pays the whole wait and launch."""
        if riders <= 1:
            return self
        cache = self.__dict__.setdefault("_at_step_end", {})
        if riders not in cache:
            cache[riders] = replace(self, wait_share=self.wait_share / riders, launch_share=1.0 / riders)
        return cache[riders]

    def with_sync_share(self, n: int) -> "CostModel":
        """This model with the wait for a group's last device paid 1/n times per
        collective (n collectives after one another's wait: ``modeled_step_time``'s
        collectives at the step's end)."""
        return self if n <= 1 or not self.measures_waits else replace(self, wait_share=self.wait_share / n)

    @functools.cached_property
    def back_to_back(self) -> "CostModel":
        """This model for a collective that follows another with no compute between them
        (the second step of one move, a collective of a collective's result): its group
        arrives together, so it pays no wait."""
        return self if not self.measures_waits else replace(self, wait_share=0.0)

    @property
    def prices_groups(self) -> bool:
        """Whether a collective's price depends on which devices its group spans (a
        profile's per-group links), not only on its kind and bytes: the memo of moves
        (``plan_core.pricing.Prices``) then keys them by the ranks their axes span."""
        return bool(self.links)

    @property
    def measures_waits(self) -> bool:
        """Whether a wait after compute is priced at all (a profile measured one)."""
        return bool(self.sync_s or self.waits)

    def wait(self, axes: tuple, mesh) -> float:
        """Seconds a collective over ``axes`` of ``mesh`` waits, after compute, for its
        group's last device (its share of it: ``wait_share``)."""
        if not self.wait_share or not self.measures_waits:
            return 0.0
        if not self.waits:
            return self.wait_share * self.sync_s
        key = ("wait", axes, mesh)
        out = self._memo.get(key)
        if out is None:
            table = dict(self.waits)
            out = table.get(group_shape(axes, mesh))
            if out is None:   # never measured as a whole: as its slowest measured axis
                parts = [table.get(group_shape((a,), mesh)) for a in set(axes) if mesh.axis_size(a) > 1]
                parts = [p for p in parts if p is not None]
                out = max(parts) if parts else self.sync_s
            self._memo[key] = out
        return self.wait_share * out

    def move_time(self, steps, mesh=None, axes_of=None) -> float:
        """Seconds for the steps of one move (``redistribute.plan_redistribution``): the
        first collective waits for its group after compute; the rest follow it back to back,
        their devices released together by it (``modeled_step_time`` prices a planned
        program's collectives so: ``collective_models``). ``axes_of(step)``: the mesh
        axes a step runs over, where its own are another mesh's (a virtual mesh's bundles)."""
        total, first = 0.0, True
        for s in steps:
            if s.kind == "slice":
                continue
            total += (self if first else self.back_to_back).step_time(s, mesh, axes_of)
            first = False
        return total

    def step_time(self, step, mesh=None, axes_of=None) -> float:
        """Seconds for one step of the redistribution planner (a local slice is free)."""
        if step.kind == "slice":
            return 0.0
        if (not self.links or mesh is None) and self.launch_share == 1.0:   # propagation's hot path
            return self.latency_s + step.wire_bytes / self.link_bytes_per_s
        axes = step.param("axes") if axes_of is None else axes_of(step)
        return self.collective_time(step.wire_bytes, step.kind, axes, mesh)

    def compute_time(self, flops: float, touched_bytes: float, contraction: bool = False, unit=None) -> float:
        """Seconds for an op's work on one device: the roofline, or for a contraction in a
        profile that measured operand streaming, its flops plus its bytes (not overlapped).
        ``unit`` (``compute_unit``) is for models with ``prices_units`` (a cluster's GPUs);
        this one prices every unit alike."""
        if contraction and self.contraction_bytes_per_s:
            return flops / self.flops_per_s + touched_bytes / self.contraction_bytes_per_s
        return max(flops / self.flops_per_s, touched_bytes / self.memory_bytes_per_s)

    def link(self, kind: str, axes: tuple, mesh) -> Link:
        key = (kind, axes, mesh)
        out = self._memo.get(key)
        if out is None:
            out = self._link_of(kind, group_shape(axes, mesh))
            if out is None:
                # never measured as a whole: as slow as its slowest axis (the larger
                # latency, the smaller bandwidth)
                parts = [self._link_of(kind, group_shape((a,), mesh)) for a in set(axes)
                         if mesh.axis_size(a) > 1]
                parts = [p or Link(self.latency_s, self.link_bytes_per_s) for p in parts]
                out = Link(max(p.latency_s for p in parts), min(p.bytes_per_s for p in parts)) if parts else \
                    Link(self.latency_s, self.link_bytes_per_s)
            self._memo[key] = out
        return out

    @functools.cached_property
    def _memo(self) -> dict:
        return {}

    @functools.cached_property
    def _table(self) -> dict:
        return {(group, kind): link for group, kind, link in self.links}

    def _link_of(self, kind: str, group: Group) -> Optional[Link]:
        table = self._table
        for k in (kind, ""):
            if (group, k) in table:
                return table[(group, k)]
        return None

    # -- meshes --------------------------------------------------------------
    def measured_groups(self) -> set:
        return {group for group, _, _ in self.links}

    def check_mesh(self, mesh) -> "CostModel":
        """This model, if it can price ``mesh``; else a ShardingError saying how to get one."""
        where = (f"measured on {self.device_count} devices ({self.device_kind or 'unknown kind'}), mesh "
                 f"{'x'.join(map(str, self.mesh_shape)) or '?'} {self.mesh_axes}")
        fix = (f"run `shardprop calibrate --mesh {'x'.join(map(str, mesh.axis_sizes))} -o profile.json` on the "
               f"machine that runs it and pass cost_model=CostModel.load('profile.json')")
        if self.device_count is not None and self.device_count != mesh.size:
            raise ShardingError(f"the cost profile {self.name!r} was {where}; it cannot price a mesh of "
                                f"{mesh.size} devices {dict(zip(mesh.axis_names, mesh.axis_sizes))}\n  fix:      {fix}")
        if self.links:
            measured = self.measured_groups()
            missing = [a for a in mesh.axis_names if mesh.axis_size(a) > 1 and group_shape((a,), mesh) not in measured]
            if missing:
                raise ShardingError(f"the cost profile {self.name!r} was {where}; it has no measurement for "
                                    f"the device groups of mesh axes {missing} of mesh "
                                    f"{dict(zip(mesh.axis_names, mesh.axis_sizes))}\n  fix:      {fix}")
        return self

    # -- profiles ------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA, "name": self.name, "device_kind": self.device_kind,
            "device_count": self.device_count,
            "mesh": {"shape": list(self.mesh_shape), "axes": list(self.mesh_axes)},
            "default_link": {"latency_s": self.latency_s, "bytes_per_s": self.link_bytes_per_s},
            "collective_sync_s": self.sync_s,
            **({"collective_waits": [{"group": [list(p) for p in group], "sync_s": w} for group, w in self.waits]}
               if self.waits else {}),
            "combined_kinds": list(self.combined_kinds),
            "compute": {"matmul_flops_per_s": self.flops_per_s, "elementwise_bytes_per_s": self.memory_bytes_per_s,
                        "contraction_bytes_per_s": self.contraction_bytes_per_s},
            **({"alone": {"matmul_flops_per_s": self.alone.flops_per_s,
                          "elementwise_bytes_per_s": self.alone.memory_bytes_per_s,
                          "contraction_bytes_per_s": self.alone.contraction_bytes_per_s}}
               if self.alone is not None else {}),
            **({"driver": {"dispatch_s": self.dispatch_s, "transfer_s": self.transfer_s}}
               if self.dispatch_s is not None or self.transfer_s is not None else {}),
            **({"at_once": [list(x) for x in self.at_once]} if self.at_once else {}),
            **({"cores_alone": dict(self.cores_alone)} if self.cores_alone else {}),
            "memory_capacity_bytes": self.memory_capacity_bytes,
            **({"kernels": self.kernels} if self.kernels != "xla" else {}),
            "links": [{"group": [list(p) for p in group], "kind": kind or "*", **asdict(link)}
                      for group, kind, link in self.links],
            "notes": self.notes,
        }

    @classmethod
    def from_dict(cls, data: dict, source: str = "profile") -> "CostModel":
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            got = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ShardingError(f"{source} is not a shardprop cost profile (schema {got!r}, expected {SCHEMA!r}); "
                                f"write one with `shardprop calibrate -o profile.json`")
        try:
            links = tuple((tuple(tuple(int(x) for x in p) for p in e["group"]),
                           "" if e["kind"] == "*" else e["kind"],
                           Link(float(e["latency_s"]), float(e["bytes_per_s"]))) for e in data["links"])
            cap = data.get("memory_capacity_bytes")
            streaming = data["compute"].get("contraction_bytes_per_s")   # absent in older profiles
            alone, driver = data.get("alone"), data.get("driver") or {}      # absent in older profiles
            if alone is not None:
                alone_streaming = alone.get("contraction_bytes_per_s")
                alone = ComputeRates(float(alone["matmul_flops_per_s"]), float(alone["elementwise_bytes_per_s"]),
                                     None if alone_streaming is None else float(alone_streaming))
            opt = lambda x: None if x is None else float(x)
            return cls(latency_s=float(data["default_link"]["latency_s"]),
                       link_bytes_per_s=float(data["default_link"]["bytes_per_s"]),
                       flops_per_s=float(data["compute"]["matmul_flops_per_s"]),
                       memory_bytes_per_s=float(data["compute"]["elementwise_bytes_per_s"]),
                       contraction_bytes_per_s=None if streaming is None else float(streaming),
                       sync_s=float(data.get("collective_sync_s", 0.0)),   # absent in older profiles
                       waits=tuple((tuple(tuple(int(x) for x in p) for p in e["group"]), float(e["sync_s"]))
                                   for e in data.get("collective_waits", ())),   # likewise
                       # absent in older profiles: what XLA:CPU combines, the only kind they were measured on
                       combined_kinds=tuple(data.get("combined_kinds", ("all_reduce",))),
                       memory_capacity_bytes=None if cap is None else int(cap), links=links,
                       device_count=data.get("device_count"),
                       mesh_shape=tuple(data["mesh"]["shape"]), mesh_axes=tuple(data["mesh"]["axes"]),
                       device_kind=data.get("device_kind", ""), name=data.get("name", ""),
                       notes=data.get("notes", ""), alone=alone, dispatch_s=opt(driver.get("dispatch_s")),
                       transfer_s=opt(driver.get("transfer_s")),
                       at_once=tuple((int(k), float(c)) for k, c in data.get("at_once", ())),
                       cores_alone=tuple((str(k), float(c)) for k, c in (data.get("cores_alone") or {}).items()),
                       kernels=data.get("kernels", "xla"))
        except (KeyError, TypeError, ValueError) as e:
            raise ShardingError(f"{source}: malformed cost profile ({type(e).__name__}: {e}); "
                                f"write a fresh one with `shardprop calibrate -o profile.json`") from None

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path, mesh=None) -> "CostModel":
        """A profile written by ``save`` (or ``shardprop calibrate``); given a mesh, it
        must be able to price it."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ShardingError(f"no cost profile at {path}; write one with `shardprop calibrate -o {path}` "
                                f"or use a built-in one: {sorted(BUILTIN)}") from None
        except json.JSONDecodeError as e:
            raise ShardingError(f"{path} is not JSON ({e}); write a profile with `shardprop calibrate`") from None
        model = cls.from_dict(data, str(path))
        return model.check_mesh(mesh) if mesh is not None else model

    @classmethod
    def builtin(cls, name: str, mesh=None) -> "CostModel":
        """``"cpu"``: forced CPU devices, measured on this project's 2-core development
        machine by ``shardprop calibrate`` (package data); ``"h100"``: one H100 NVLink
        node from published figures."""
        if name not in BUILTIN:
            raise ShardingError(f"no built-in cost profile {name!r}; the built-in ones are {sorted(BUILTIN)}, "
                                f"or pass CostModel.load(path) for a profile from `shardprop calibrate`")
        model = BUILTIN[name]()
        return model.check_mesh(mesh) if mesh is not None else model

    def with_memory_capacity(self, nbytes: Optional[int]) -> "CostModel":
        return replace(self, memory_capacity_bytes=nbytes)


def _h100() -> CostModel:
    # Published figures, NVIDIA H100 SXM5 datasheet: 80 GB HBM3 at 3.35 TB/s; TF32
    # tensor cores 989 TFLOPS with sparsity, so 494.7 dense (jax runs float32 matmuls
    # on TF32 by default on GPUs); NVLink 4 at 900 GB/s per GPU in both directions,
    # 450 GB/s each way, every GPU of a DGX/HGX node one hop away through NVSwitch, so
    # every group of one node looks alike. Collective bandwidth per device: nccl-tests
    # report ~360 GB/s bus bandwidth for large all_reduces on 8 H100s (80% of the link);
    # small-message latency of an NCCL collective on one node is ~10 us.
    return CostModel(latency_s=10e-6, link_bytes_per_s=360e9, flops_per_s=494.7e12,
                     memory_bytes_per_s=3.35e12, memory_capacity_bytes=80 * 10**9, device_count=None,
                     device_kind="NVIDIA H100 SXM5 (NVLink 4, NVSwitch)", name="h100",
                     notes="from published figures, not measured: one node of up to 8 GPUs")


def _cpu() -> CostModel:
    return CostModel.load(PROFILES / "cpu-8.json")


BUILTIN = {"cpu": _cpu, "h100": _h100}


def resolve_cost_model(cost_model, mesh) -> CostModel:
    """``parallelize``'s ``cost_model``: None (the default model), a ``CostModel``,
    a ``Cluster`` (``passes/cluster.py``), or the name of a built-in profile; checked
    against the mesh it will price."""
    if cost_model is None:
        return DEFAULT_COST
    if callable(getattr(cost_model, "cost_model", None)):   # a cluster (passes/cluster.py) describes its model
        cost_model = cost_model.cost_model()
    if isinstance(cost_model, str):
        model = CostModel.builtin(cost_model)
    elif isinstance(cost_model, CostModel):
        model = cost_model
    else:
        raise ShardingError(f"cost_model={cost_model!r} is not a CostModel or a built-in profile name "
                            f"{sorted(BUILTIN)}; load a calibrated one with CostModel.load(path)")
    if model.name == "h100" and mesh.size > 8:
        raise ShardingError(f"the built-in h100 profile describes one NVLink node of 8 GPUs, not a mesh of "
                            f"{mesh.size} devices; run `shardprop calibrate --mesh ...` on the cluster")
    return model.check_mesh(mesh)


DEFAULT_COST = CostModel()


def wire_bytes(kind: str, local_bytes: float, group: int) -> float:
    """Bytes each device sends for one collective on a local buffer of ``local_bytes``
    (ring algorithms; the input buffer for all_gather, reduce_scatter and all_reduce)."""
    if group <= 1 or kind == "slice":
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (group - 1) / group * local_bytes
    if kind in ("reduce_scatter", "all_to_all"):
        return (group - 1) / group * local_bytes
    if kind == "all_gather":
        return float(group - 1) * local_bytes
    if kind == "permute":
        return float(local_bytes)
    raise ValueError(f"unknown collective kind {kind!r}")


def tensor_factors(op, rule, resident=frozenset()) -> tuple:
    """What an op's work per device depends on besides its strategy: for each operand and
    result that reaches memory, (whole bytes, the factors its dims carry); an operand the
    rule leaves out (None) is read whole; a ``resident`` value (``fusion.resident_values``:
    fused into the loop that makes or reads it) touches no memory. Equal ops (repeated
    layers) give equal tuples."""
    out = []
    for values, tensors in ((op.inputs, rule.operands), (op.outputs, rule.results)):
        for i, v in enumerate(values):
            if v in resident:
                continue
            dims = tensors[i] if i < len(tensors) else None
            out.append((v.type.nbytes, () if dims is None else tuple(sorted({f for d in dims for f in d}))))
    return tuple(out)


def is_contraction(rule) -> bool:
    """A matmul or convolution: arithmetic summed over a factor absent from its result."""
    return bool(rule.reduction) and rule.flops > 0


MATMULS = frozenset({"dot_general", "conv_general_dilated"})


def compute_unit(op) -> str:
    """Which unit of a GPU does an op's arithmetic: "matmul" (a dot or convolution on
    16-bit or narrower floats: tensor cores), "matmul_fp32" (one with a 32-bit or wider
    operand) or "vector" (everything else: the CUDA cores)."""
    if op.kind in MATMULS:
        return "matmul_fp32" if any(v.type.itemsize >= 4 for v in op.inputs) else "matmul"
    return "vector"


def strategy_work(flops: float, factors, tensors: tuple, mesh) -> tuple[float, float]:
    """An op's work per device under a strategy (its factors' mesh axes): its flops
    divided over the devices the factors split, and the bytes of each operand and
    result at its local size (``tensors``: ``tensor_factors``), so a tensor left whole
    is read whole on every device."""
    degree = math.prod(mesh.axes_size(a) for a in factors if a)
    local = 0.0
    for nbytes, fs in tensors:
        axes = {a for f in fs if f < len(factors) and factors[f] for a in factors[f]}
        local += nbytes / (mesh.axes_size(tuple(sorted(axes))) if axes else 1)
    return flops / degree, local


class ComputeTimes:
    """What a strategy costs in compute: the one definition propagation, the search
    and the step model share (``CostModel.compute_time`` of ``strategy_work``),
    memoized for one cost model and mesh; ``resident``: the values of the graph
    priced that fusion keeps out of memory (``fusion.resident_values``); ``rules``:
    op -> its rule where the caller has them (a plan context's), else built here."""

    def __init__(self, cost: CostModel, mesh, resident=frozenset(), rules=None):
        self.cost, self.mesh, self.resident, self.rules = cost, mesh, resident, rules
        # op -> (tensor_factors(op, rule), is_contraction(rule), compute_unit(op) or None)
        self._tensors: dict = {}
        self._memo: dict = {}      # (flops, factors, tensors, contraction) -> seconds: all the time depends on

    def tensors(self, op) -> tuple:
        """What an op's compute reads of it: (tensor_factors, is_contraction, its
        ``compute_unit`` where the model prices units, else None)."""
        t = self._tensors.get(op)
        if t is None:
            if self.rules is not None:
                rule = self.rules[op]
            else:
                from .rules import rule_for
                rule = rule_for(op)
            t = self._tensors[op] = (tensor_factors(op, rule, self.resident), is_contraction(rule),
                                     compute_unit(op) if self.cost.prices_units else None)
        return t

    def work(self, op, flops: float, factors) -> tuple[float, float]:
        """(flops, bytes touched) per device."""
        return strategy_work(flops, factors, self.tensors(op)[0], self.mesh)

    def time(self, op, flops: float, factors) -> float:
        """Seconds per device."""
        key = (flops, tuple(factors), *self.tensors(op))
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = self.cost.compute_time(*strategy_work(flops, key[1], key[2], self.mesh),
                                                         contraction=key[3], unit=key[4])
        return t


# XLA's combiners merge collectives of one kind that do not depend on each other (a data
# parallel step's gradient reductions) into one, up to a buffer of this many bytes
COMBINE_BYTES = 30 * 2**20


def combined_collectives(graph, kinds=("all_reduce",)) -> set:
    """The collectives of ``graph`` that ride in an earlier one's launch: the compiler
    combines collectives of one of ``kinds`` over the same device groups when neither
    depends on the other (so a data parallel step launches one all_reduce, not one per
    gradient), until the buffer reaches ``COMBINE_BYTES``. Greedy in program order: each
    joins the first open launch of its kind and axes that none of its inputs came from."""
    ancestors: dict = {}    # value -> bitmask of the collectives it was computed from
    bit: dict = {}          # collective op -> its bit
    launches: dict = {}     # (kind, axes) -> [(mask of members, bytes)]
    riders: set = set()
    for op in graph.ops:
        mask = 0
        for v in op.inputs:
            mask |= ancestors.get(v, 0)
        if op.kind in kinds:
            size = sum(v.type.nbytes for v in op.inputs)
            open_ = launches.setdefault((op.kind, tuple(op.params.get("axes") or ())), [])
            for k, (members, nbytes) in enumerate(open_):
                if not members & mask and nbytes + size <= COMBINE_BYTES:
                    open_[k] = (members | 1 << len(bit), nbytes + size)
                    riders.add(op)
                    break
            else:
                open_.append((1 << len(bit), size))
            bit[op] = len(bit)
            mask |= 1 << bit[op]
        for v in op.outputs:
            ancestors[v] = mask
    return riders


def terminal_values(graph) -> frozenset:
    """The values of ``graph`` whose redistribution can wait for the step's end: nothing
    but elementwise ops, transposes, reshapes and reductions lie between them and the
    outputs (a gradient on its way to the optimizer's update, a loss). No matmul waits
    for them, so their collectives do not depend on each other and the compiler
    launches those of a kind together (``combined_collectives``); the search prices
    them with ``CostModel.at_step_end``."""
    from .fusion import LOOP_FUSIBLE, REDUCTIONS
    readers = graph.users()
    terminal: set = set()

    def waits_for_the_end(v) -> bool:   # every reader a fused tail op whose results are terminal
        return all((u.kind in LOOP_FUSIBLE or u.kind in REDUCTIONS) and not u.subgraphs
                   and all(w in terminal for w in u.outputs) for u in readers.get(v, ()))
    for op in reversed(graph.ops):
        terminal.update(v for v in op.outputs if waits_for_the_end(v))
    terminal.update(v for v in graph.inputs if waits_for_the_end(v))
    return frozenset(terminal)


def launch_riders(graph, terminal: frozenset) -> int:
    """How many collectives could share one launch at the step's end: the terminal values
    made by an op outside the fused elementwise tail (a matmul, a reduction; not an
    argument), the ones that can arrive as partial sums or split. A step's gradients
    give one each; a forward pass whose last matmul leaves a partial output, one."""
    from .fusion import LOOP_FUSIBLE
    return sum(1 for op in graph.ops if op.kind not in LOOP_FUSIBLE
               for v in op.outputs if v in terminal)


class StepEnd:
    """A graph's values whose collectives wait for the step's end (``terminal_values``)
    and how many reductions share their launch (``launch_riders``): what propagation and
    the search both need to price moving a value."""

    def __init__(self, graph):
        self.terminal = terminal_values(graph)
        self.riders = launch_riders(graph, self.terminal)

    def cost_for(self, cost: CostModel, v) -> CostModel:
        """The model that prices moving ``v``: a terminal value's all_reduces ride in one
        launch with the others (``CostModel.at_step_end``)."""
        return cost.at_step_end(self.riders) if v in self.terminal else cost


def modeled_step_time(graph, cost: CostModel) -> dict:
    """What ``cost`` says a planned (localized) graph's step takes per device:
    {"compute": s, "communication": s, "total": s, "collectives": n, "launched": n}. Each
    op's work is its rule's flops and the bytes it touches (but those fusion keeps out of
    memory), divided over the devices its strategy splits it on (a loop's or branch's rule
    already holds its body's work); each collective is priced by its kind, axes and wire
    bytes, once per iteration of a scan around it (a while loop's count is unknown: once;
    every branch of a cond); a collective the compiler combines into an earlier one's
    launch (``combined_collectives``) pays its bytes but no latency of its own, a collective
    whose result nothing computes on before the step ends (``terminal_values``) pays its
    share of one wait for its group (``CostModel.at_step_end``), and one that takes another's
    result (a move's second step) pays none (``CostModel.back_to_back``). ``collectives``
    counts the planned ones, ``launched`` those left after combining."""
    out = {"compute": 0.0, "communication": 0.0, "collectives": 0, "launched": 0}
    _add_step_time(graph, cost, graph.mesh, 1, True, out)
    out["total"] = out["compute"] + out["communication"]
    return out


def collective_models(graph, cost: CostModel) -> tuple[dict, frozenset]:
    """(planned collective op -> the model that prices it, the riders): a collective whose
    result nothing computes on before the step ends (``terminal_values``) shares one wait
    for its group with the others there (``with_sync_share``); one that takes another's
    result, a move's second step, follows it back to back (``back_to_back``); the rest wait
    in full. The riders (``combined_collectives``) travel in an earlier launch: they pay
    their bytes and no latency of their own."""
    from ..ir.graph import is_collective
    riders = combined_collectives(graph, cost.combined_kinds)
    terminal = terminal_values(graph)
    planned = [op for op in graph.ops if is_collective(op) and op.kind != "slice"]
    at_end = {op for op in planned if all(v in terminal for v in op.outputs)}
    end_model = cost.with_sync_share(len(at_end - riders))
    made_by = graph.producers()

    def after_a_collective(op) -> bool:   # (a slice between them is no compute to wait for)
        src = made_by.get(op.inputs[0]) if op.inputs else None
        while src is not None and src.kind == "slice" and src.prim is None:
            src = made_by.get(src.inputs[0])
        return src is not None and is_collective(src)
    models = {}
    for op in planned:
        model = end_model if op in at_end else cost
        models[op] = model.back_to_back if after_a_collective(op) else model
    return models, riders


def trips(op) -> int:
    """How many times the model counts a loop or branch op's body per run of the op: a
    scan's length; a while's count is unknown, so once; each branch of a cond once."""
    return op.params.get("length", 1) if op.kind == "scan" else 1


def _add_step_time(graph, cost: CostModel, mesh, times: int, compute: bool, out: dict) -> None:
    from ..ir.graph import is_collective
    from .fusion import resident_values
    resident = resident_values(graph, cost.kernels) if compute else frozenset()
    models, riders = collective_models(graph, cost)
    for op in graph.ops:
        if is_collective(op):
            if op.kind != "slice":
                axes = op.params.get("axes") or ()
                model = models[op]
                seconds = model.collective_time(op.params.get("wire_bytes", 0), op.kind, axes, mesh)
                if op in riders:   # its bytes travel in an earlier launch
                    seconds -= model.collective_time(0, op.kind, axes, mesh)
                else:
                    out["launched"] += times
                out["collectives"] += times
                out["communication"] += times * seconds
            continue
        st = op.strategy
        if compute and st is not None:
            out["compute"] += times * cost.compute_time(*strategy_work(st.rule.flops, st.factors,
                                                                       tensor_factors(op, st.rule, resident), mesh),
                                                        contraction=is_contraction(st.rule),
                                                        unit=compute_unit(op) if cost.prices_units else None)
        for sub in op.subgraphs:
            _add_step_time(sub, cost, mesh, times * trips(op), False, out)
