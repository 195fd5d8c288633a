"""Nodes and links: a cluster of GPU nodes as a cost model (issue 28).

``Cluster(nodes=128, gpus_per_node=8, gpu="a100-80gb")`` describes the machines a
plan is for; passed as ``cost_model=`` it becomes a ``ClusterCost``, a ``CostModel``
that knows which devices share a node:

- mesh axes map to devices as ``jax.make_mesh`` / ``mesh_utils`` lay them out on a
  cluster: row-major, trailing axes fastest, so the trailing axes fill a node first
  (rank r sits on node ``r // gpus_per_node``);
- a collective's group is known by its rank geometry (``cost.group_shape``: runs of
  (size, stride)), never by listing devices: how many of a group's members share a
  node (``intra``) is worked out once per geometry from the pattern, so pricing is
  independent of the mesh's size;
- a group inside one node is priced at NVLink's bandwidth and latency, a group with
  one member per node at the NIC's, and a group spanning both (k members in each of m
  nodes) as a hierarchical collective: an all_reduce reduce-scatters inside the node,
  all-reduces 1/k of the buffer across nodes and all-gathers inside the node
  (``hierarchical_time``);
- a contraction's time is its flops at the tensor cores' dense peak plus a kernel's
  fixed overhead (its efficiency by size: ``matmul_efficiency``); other ops stay on
  the roofline of the GPU's HBM bandwidth.

The GPUs' figures are package data (``profiles/<name>.json``, schema
``shardprop.gpu/1``), each with its published source; the few that no datasheet gives
(latencies, a kernel's overhead) say so. They are never fitted to a benchmark.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field

from ..ir.errors import ShardingError
from .cost import PROFILES, CostModel, group_shape

GPU_SCHEMA = "shardprop.gpu/1"
GPUS = ("v100-32gb", "a100-80gb", "h100-80gb")


@dataclass(frozen=True)
class GpuProfile:
    """One GPU and its links, from its datasheet (``profiles/<name>.json``)."""
    name: str
    device_kind: str
    matmul_flops_per_s: float     # dense bf16/fp16 tensor-core peak
    memory_bytes_per_s: float     # HBM
    memory_capacity_bytes: int
    nvlink_bytes_per_s: float     # per GPU, each way
    nvlink_latency_s: float
    nic_bytes_per_s: float        # per GPU, each way
    nic_latency_s: float
    kernel_overhead_s: float
    sources: dict = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def builtin(cls, name: str) -> "GpuProfile":
        key = name.lower()
        if key not in GPUS:
            raise ShardingError(f"no built-in GPU profile {name!r}; the built-in ones are {list(GPUS)}")
        return _gpu(key)

    def matmul_efficiency(self, flops: float) -> float:
        """The share of the dense peak a matmul of ``flops`` (on one device) reaches: its
        arithmetic at peak over that plus a kernel's fixed overhead."""
        t = flops / self.matmul_flops_per_s
        return t / (t + self.kernel_overhead_s) if flops > 0 else 0.0


@functools.lru_cache(maxsize=16)
def _gpu(name: str) -> GpuProfile:
    data = json.loads((PROFILES / f"{name}.json").read_text())
    if data.get("schema") != GPU_SCHEMA:
        raise ShardingError(f"profiles/{name}.json is not a GPU profile (schema {data.get('schema')!r})")
    return GpuProfile(**{k: (float(v) if isinstance(v, (int, float)) and k != "memory_capacity_bytes" else v)
                         for k, v in data.items() if k != "schema"})


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines of ``gpus_per_node`` GPUs each (a built-in GPU name or a
    ``GpuProfile``). Pass it as ``cost_model=`` to ``parallelize`` or ``sp.plan_step``."""
    nodes: int
    gpus_per_node: int = 8
    gpu: object = "a100-80gb"

    def __post_init__(self):
        if not (isinstance(self.nodes, int) and self.nodes >= 1 and isinstance(self.gpus_per_node, int)
                and self.gpus_per_node >= 1):
            raise ShardingError(f"Cluster(nodes={self.nodes!r}, gpus_per_node={self.gpus_per_node!r}): both must be "
                                "positive integers")
        if isinstance(self.gpu, str):
            object.__setattr__(self, "gpu", GpuProfile.builtin(self.gpu))
        elif not isinstance(self.gpu, GpuProfile):
            raise ShardingError(f"Cluster(gpu={self.gpu!r}): give a built-in GPU name {list(GPUS)} or a GpuProfile")

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def parse(cls, text: str) -> "Cluster":
        """``"128x8:a100-80gb"``: nodes x GPUs per node : GPU (the command line's ``--cluster``)."""
        try:
            shape, gpu = text.split(":") if ":" in text else (text, "a100-80gb")
            nodes, per = (int(x) for x in shape.lower().split("x"))
        except ValueError:
            raise ShardingError(f"--cluster {text!r}: write NODESxGPUS_PER_NODE:GPU, e.g. 128x8:a100-80gb "
                                f"(GPUs: {list(GPUS)})") from None
        return cls(nodes, per, gpu)

    def cost_model(self) -> "ClusterCost":
        g = self.gpu
        return ClusterCost(latency_s=g.nvlink_latency_s, link_bytes_per_s=g.nvlink_bytes_per_s,
                           flops_per_s=g.matmul_flops_per_s, memory_bytes_per_s=g.memory_bytes_per_s,
                           memory_capacity_bytes=g.memory_capacity_bytes, device_kind=g.device_kind,
                           name=f"cluster {self.nodes}x{self.gpus_per_node} {g.name}",
                           notes="published figures (passes/profiles), not measured", cluster=self)

    def __str__(self):
        return f"{self.nodes} nodes x {self.gpus_per_node} {self.gpu.name} ({self.devices} GPUs)"


def intra_node_members(group: tuple, gpus_per_node: int) -> int:
    """How many members of a collective group of geometry ``group`` ((size, stride), ...)
    share a node with the group's first rank: groups of a row-major mesh start at a
    multiple of their smallest stride, so every group of the geometry has as many. Worked
    out from the pattern (at most the group's size in offsets, once per geometry)."""
    offsets = [0]
    for size, stride in group:
        offsets = [o + i * stride for o in offsets for i in range(size) if o + i * stride < gpus_per_node]
        if not offsets:
            break
    k = max(1, len(offsets))
    return k


def hierarchical_time(kind: str, wire_bytes: float, n: int, k: int, g: GpuProfile) -> tuple[float, float]:
    """(latency, bandwidth time) of one collective over a group of ``n`` devices, ``k``
    of them in each of ``m = n / k`` nodes, moving ``wire_bytes`` per device by the ring
    formulas (``cost.wire_bytes``). Inside a node (m = 1) and one per node (k = 1) it is
    the ring on NVLink or the NIC; spanning both it is hierarchical:

    - all_reduce of B bytes: reduce_scatter in the node, all_reduce of B/k across nodes,
      all_gather in the node: 2(k-1)/k B / nvlink + 2(m-1)/m B/k / nic, latency 2 a_nv + a_nic;
    - reduce_scatter of B: (k-1)/k B / nvlink + (m-1)/m B/k / nic, latency a_nv + a_nic;
    - all_gather of b per device: (m-1) b / nic + (k-1) m b / nvlink, latency a_nv + a_nic;
    - all_to_all of B: (k-1)/n B / nvlink + (n-k)/n B / nic, latency a_nic;
    - permute: the NIC.
    """
    m = max(1, n // max(k, 1))
    if n <= 1 or wire_bytes <= 0 and kind != "permute":
        return (0.0, 0.0) if n <= 1 else ((g.nvlink_latency_s if m == 1 else g.nic_latency_s), 0.0)
    if m == 1:
        return g.nvlink_latency_s, wire_bytes / g.nvlink_bytes_per_s
    if k == 1 or kind == "permute":
        return g.nic_latency_s, wire_bytes / g.nic_bytes_per_s
    nv, ib = g.nvlink_bytes_per_s, g.nic_bytes_per_s
    if kind == "all_reduce":
        b = wire_bytes * n / (2 * (n - 1))
        return 2 * g.nvlink_latency_s + g.nic_latency_s, 2 * (k - 1) / k * b / nv + 2 * (m - 1) / m * b / k / ib
    if kind == "reduce_scatter":
        b = wire_bytes * n / (n - 1)
        return g.nvlink_latency_s + g.nic_latency_s, (k - 1) / k * b / nv + (m - 1) / m * b / k / ib
    if kind == "all_gather":
        b = wire_bytes / (n - 1)
        return g.nvlink_latency_s + g.nic_latency_s, (m - 1) * b / ib + (k - 1) * m * b / nv
    if kind == "all_to_all":
        b = wire_bytes * n / (n - 1)
        return g.nic_latency_s, (k - 1) / n * b / nv + (n - k) / n * b / ib
    raise ValueError(f"unknown collective kind {kind!r}")


@dataclass(frozen=True)
class ClusterCost(CostModel):
    """A ``CostModel`` for a ``Cluster``: collectives priced by where their groups'
    members sit (``hierarchical_time``), contractions by the GPU's efficiency curve."""
    cluster: Cluster = None

    def __hash__(self):
        return hash((CostModel.__hash__(self), self.cluster))

    def check_mesh(self, mesh) -> "ClusterCost":
        if mesh.size > self.cluster.devices:
            raise ShardingError(f"the mesh {dict(zip(mesh.axis_names, mesh.axis_sizes))} needs {mesh.size} devices "
                                f"but the cluster has {self.cluster.devices} ({self.cluster})")
        return self

    def split(self, axes, mesh) -> tuple[int, int]:
        """(n, k): a group over ``axes`` has n members, k of them in each node."""
        return self._split(group_shape(tuple(axes), mesh))

    @functools.lru_cache(maxsize=4096)   # per geometry (a few per mesh)  # noqa: B019
    def _split(self, group: tuple) -> tuple[int, int]:
        n = math.prod(s for s, _ in group)
        return n, min(n, intra_node_members(group, self.cluster.gpus_per_node))

    def link_class(self, axes, mesh) -> str:
        """"intra" (NVLink), "inter" (NIC) or "both" (hierarchical) for a group over ``axes``."""
        n, k = self.split(axes, mesh)
        return "intra" if k == n else "inter" if k == 1 else "both"

    def collective_time(self, wire_bytes: float, kind=None, axes=None, mesh=None) -> float:
        if not axes or mesh is None:   # a group nobody named: the slowest link
            lat, bw = self.cluster.gpu.nic_latency_s, self.cluster.gpu.nic_bytes_per_s
            latency, seconds = lat, wire_bytes / bw
        else:
            n, k = self.split(axes, mesh)
            latency, seconds = hierarchical_time(kind or "all_reduce", wire_bytes, n, k, self.cluster.gpu)
        share = self.launch_share if kind in self.combined_kinds else 1.0
        return share * latency + seconds

    def step_time(self, step, mesh=None) -> float:
        if step.kind == "slice":
            return 0.0
        return self.collective_time(step.wire_bytes, step.kind, step.param("axes"), mesh)

    def compute_time(self, flops: float, touched_bytes: float, contraction: bool = False) -> float:
        if contraction and flops > 0:
            return max(flops / self.flops_per_s + self.cluster.gpu.kernel_overhead_s,
                       touched_bytes / self.memory_bytes_per_s)
        return max(flops / self.flops_per_s, touched_bytes / self.memory_bytes_per_s)


def as_cost_model(cost_model):
    """A ``Cluster`` becomes its ``ClusterCost``; anything else is returned as it is."""
    return cost_model.cost_model() if isinstance(cost_model, Cluster) else cost_model
