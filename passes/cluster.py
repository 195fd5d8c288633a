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
  (``hierarchical_time``), or, with ``Cluster(collectives="ring")``, as one flat ring
  whose every step crosses the node's NICs (``ring_time``: NCCL's ring);
- NVLink moves a collective's data at ``GpuProfile.nvlink_efficiency`` of its peak
  (NCCL's own model of a link), and on a node without an NVSwitch (DGX-1's hybrid cube
  mesh: ``GpuProfile.nvlink_links``) a group has only the links between its members,
  the node's slowest group setting the pace (``ClusterCost._gpu_for``);
- a matmul or convolution on 16-bit floats runs on the tensor cores at the dense peak
  times the GPU's matmul-efficiency curve by size (``GpuProfile.matmul_efficiency``:
  published measurements of the fraction of peak a GEMM of that many flops reaches,
  and a kernel's launch overhead as the floor of its time); one on 32-bit floats at the
  float32 matmul peak (TF32 where XLA uses it) times the same curve; every other op's
  arithmetic at the float32 (CUDA core) peak. Every op is bounded below by its bytes at
  the HBM rate a streaming kernel measurably reaches (``GpuProfile.streaming_bytes_per_s``;
  the datasheet's where no measurement is cited): the roofline, where the optimizer's
  float32 update on the master weights is priced.

The GPUs' figures are package data (``profiles/<name>.json``, schema
``shardprop.gpu/1``), each with its published source; the few that no datasheet gives
(latencies, a kernel's overhead) say so. They are never fitted to a benchmark.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field

from ..ir.errors import ShardingError
from .cost import PROFILES, CostModel, group_shape

GPU_SCHEMA = "shardprop.gpu/1"
GPUS = ("v100-32gb", "a100-80gb", "h100-80gb", "h200-141gb")


@dataclass(frozen=True)
class GpuProfile:
    """One GPU and its links, from its datasheet (``profiles/<name>.json``)."""
    name: str
    device_kind: str
    matmul_flops_per_s: float     # dense bf16/fp16 tensor-core peak
    fp32_matmul_flops_per_s: float   # a float32 matmul's peak (TF32 tensor cores, or CUDA cores)
    fp32_flops_per_s: float       # CUDA cores, float32: every other op's arithmetic
    memory_bytes_per_s: float     # HBM
    memory_capacity_bytes: int
    nvlink_bytes_per_s: float     # per GPU, each way
    nvlink_latency_s: float
    nic_bytes_per_s: float        # per GPU, each way
    nic_latency_s: float
    kernel_overhead_s: float
    # ((flops, fraction of peak), ...): published GEMM measurements, flops ascending,
    # fractions non-decreasing (``matmul_efficiency``)
    matmul_efficiency_points: tuple = ()
    # what a streaming kernel measurably reaches of the HBM (0: the datasheet's figure)
    memory_achieved_bytes_per_s: float = 0.0
    # a node without an NVSwitch (DGX-1's hybrid cube mesh): links between each pair of its
    # GPUs, each at ``nvlink_link_bytes_per_s`` each way; () : every GPU one hop from all
    nvlink_links: tuple = ()
    nvlink_link_bytes_per_s: float = 0.0
    # the share of NVLink's bandwidth a collective moves data at (packet overhead)
    nvlink_efficiency: float = 1.0
    sources: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        pts = self.matmul_efficiency_points
        if any(not (0 < f <= 1) for _, f in pts) or any(a[0] >= b[0] or a[1] > b[1] for a, b in zip(pts, pts[1:])):
            raise ShardingError(f"GPU profile {self.name!r}: matmul_efficiency points {list(pts)} must be "
                                "(flops, fraction) with flops ascending and fractions in (0, 1], non-decreasing")
        if not 0 < self.nvlink_efficiency <= 1:
            raise ShardingError(f"GPU profile {self.name!r}: nvlink_efficiency {self.nvlink_efficiency} must be in (0, 1]")
        links = self.nvlink_links
        if links and (self.nvlink_link_bytes_per_s <= 0 or any(len(row) != len(links) for row in links)
                      or any(links[i][j] != links[j][i] or links[i][i] for i in range(len(links))
                             for j in range(len(links)))):
            raise ShardingError(f"GPU profile {self.name!r}: nvlink_links must be a symmetric square matrix of link "
                                "counts with a zero diagonal, and nvlink_link_bytes_per_s positive")

    @property
    def streaming_bytes_per_s(self) -> float:
        """The HBM rate a memory-bound kernel is priced at: the measured one where the
        profile cites a measurement, else the datasheet's."""
        return self.memory_achieved_bytes_per_s or self.memory_bytes_per_s

    def group_nvlink_bytes_per_s(self, members) -> float:
        """Each way, per GPU, what a collective among ``members`` (GPU indices in one
        node) can move over NVLink: on a switched node the GPU's whole NVLink bandwidth;
        on a direct-link mesh (``nvlink_links``) only the links between members carry
        it, so the member with the fewest links to the others sets the pace (NCCL lays
        one ring channel per link, each hop one link)."""
        if not self.nvlink_links or len(members) <= 1:
            return self.nvlink_bytes_per_s
        links = min(sum(self.nvlink_links[x][y] for y in members if y != x) for x in members)
        return min(self.nvlink_bytes_per_s, links * self.nvlink_link_bytes_per_s)

    @classmethod
    def builtin(cls, name: str) -> "GpuProfile":
        key = name.lower()
        if key not in GPUS:
            raise ShardingError(f"no built-in GPU profile {name!r}; the built-in ones are {list(GPUS)}")
        return _gpu(key)

    def sustained_fraction(self, flops: float) -> float:
        """The fraction of peak the published measurements give a GEMM of ``flops``:
        interpolated in log(flops) between the points, held at the first below it and
        at the last above it (a larger GEMM tiles at least as well); 1 without points."""
        pts = self.matmul_efficiency_points
        if not pts:
            return 1.0
        if flops <= pts[0][0]:
            return pts[0][1]
        for (f0, e0), (f1, e1) in zip(pts, pts[1:]):
            if flops <= f1:
                return e0 + (e1 - e0) * math.log(flops / f0) / math.log(f1 / f0)
        return pts[-1][1]

    def matmul_time(self, flops: float, peak: float = None) -> float:
        """Seconds for a matmul of ``flops`` on one GPU: its flops at the peak (the
        tensor cores' unless given) times the measured fraction, and never less than a
        kernel's launch overhead."""
        if flops <= 0:
            return 0.0
        return max(flops / ((peak or self.matmul_flops_per_s) * self.sustained_fraction(flops)),
                   self.kernel_overhead_s)

    def matmul_efficiency(self, flops: float) -> float:
        """The share of the dense peak a matmul of ``flops`` (on one device) reaches: the
        curve by size, non-decreasing and in (0, 1]. Above the launch overhead's floor it
        is the measured fraction; below, the floor's share."""
        return flops / self.matmul_flops_per_s / self.matmul_time(flops) if flops > 0 else 0.0


@functools.lru_cache(maxsize=16)
def _gpu(name: str) -> GpuProfile:
    data = json.loads((PROFILES / f"{name}.json").read_text())
    if data.get("schema") != GPU_SCHEMA:
        raise ShardingError(f"profiles/{name}.json is not a GPU profile (schema {data.get('schema')!r})")
    fields = {k: (float(v) if isinstance(v, (int, float)) and k != "memory_capacity_bytes" else v)
              for k, v in data.items() if k not in ("schema", "matmul_efficiency", "nvlink_links")}
    points = tuple((float(f), float(e)) for f, e in data.get("matmul_efficiency", ()))
    links = tuple(tuple(int(n) for n in row) for row in data.get("nvlink_links", ()))
    return GpuProfile(**fields, matmul_efficiency_points=points, nvlink_links=links)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines of ``gpus_per_node`` GPUs each (a built-in GPU name or a
    ``GpuProfile``). Pass it as ``cost_model=`` to ``parallelize`` or ``sp.plan_step``.
    ``collectives``: how a group spanning nodes runs an all_reduce, reduce_scatter or
    all_gather: ``"hierarchical"`` (in the node, across nodes, in the node:
    ``hierarchical_time``) or ``"ring"`` (one flat ring over every member, as NCCL runs
    them without a hierarchical decomposition: ``ring_time``). ``kernels``: which traced
    ops one kernel runs, as the program's framework launched them (``CostModel.kernels``:
    "xla", "unfused", "megatron-2021")."""
    nodes: int
    gpus_per_node: int = 8
    gpu: object = "a100-80gb"
    collectives: str = "hierarchical"
    kernels: str = "xla"

    def __post_init__(self):
        if self.collectives not in SPANNING:
            raise ShardingError(f"Cluster(collectives={self.collectives!r}): one of {sorted(SPANNING)}")
        if not (isinstance(self.nodes, int) and self.nodes >= 1 and isinstance(self.gpus_per_node, int)
                and self.gpus_per_node >= 1):
            raise ShardingError(f"Cluster(nodes={self.nodes!r}, gpus_per_node={self.gpus_per_node!r}): both must be "
                                "positive integers")
        from .fusion import builtin_policy
        builtin_policy(self.kernels)   # an unknown name: a ShardingError naming the known ones
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
                           flops_per_s=g.matmul_flops_per_s, memory_bytes_per_s=g.streaming_bytes_per_s,
                           memory_capacity_bytes=g.memory_capacity_bytes, device_kind=g.device_kind,
                           name=f"cluster {self.nodes}x{self.gpus_per_node} {g.name}",
                           notes="published figures (passes/profiles), not measured", cluster=self,
                           kernels=self.kernels)

    def __str__(self):
        ring = ", flat-ring collectives" if self.collectives == "ring" else ""
        return f"{self.nodes} nodes x {self.gpus_per_node} {self.gpu.name} ({self.devices} GPUs{ring})"


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


def node_groups(group: tuple, gpus_per_node: int) -> list:
    """The members inside one node of each collective group of geometry ``group``
    ((size, stride), ...), as GPU indices in the node: a row-major mesh puts rank r on
    GPU ``r % gpus_per_node`` of node ``r // gpus_per_node``, and every node is cut the
    same way, so node 0's groups are all of them. A member's coordinate along a run is
    ``(r // stride) % size``; its group is every combination of the others."""
    out = set()
    for x in range(gpus_per_node):
        base = x - sum((x // stride) % size * stride for size, stride in group)
        members = [base]
        for size, stride in group:
            members = [m + i * stride for m in members for i in range(size)]
        out.add(tuple(sorted(m for m in members if 0 <= m < gpus_per_node)))
    return sorted(out)


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


def ring_time(kind: str, wire_bytes: float, n: int, k: int, g: GpuProfile) -> tuple[float, float]:
    """(latency, bandwidth time) of one collective over ``n`` devices, ``k`` in each node,
    run as one flat ring over every member (NCCL's ring, what a collective over a group
    spanning nodes runs unless the compiler decomposes it): each device sends
    ``wire_bytes`` (the ring formulas), and at every step the ring's traffic also enters
    and leaves each node, through the ``k`` NICs of the group's ``k`` members there (one
    ring channel per NIC), so it moves at the slower of NVLink and ``k`` NICs. Inside a
    node, one per node, all_to_all and permute: as ``hierarchical_time``."""
    m = max(1, n // max(k, 1))
    if n <= 1 or m == 1 or k == 1 or kind not in ("all_reduce", "reduce_scatter", "all_gather") or wire_bytes <= 0:
        return hierarchical_time(kind, wire_bytes, n, k, g)
    return g.nic_latency_s, wire_bytes / min(g.nvlink_bytes_per_s, k * g.nic_bytes_per_s)


SPANNING = {"hierarchical": hierarchical_time, "ring": ring_time}


@dataclass(frozen=True)
class ClusterCost(CostModel):
    """A ``CostModel`` for a ``Cluster``: collectives priced by where their groups'
    members sit (``hierarchical_time``), ops by the GPU unit that runs them
    (``compute_time``)."""
    cluster: Cluster = None
    prices_units = True   # the callers pass ``cost.compute_unit`` of each op
    prices_groups = True  # a collective's price depends on the nodes its group spans

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

    @functools.lru_cache(maxsize=4096)   # per geometry  # noqa: B019
    def _gpu_for(self, group: tuple) -> GpuProfile:
        """The GPU profile a group of this geometry is priced with: its NVLink
        bandwidth at ``nvlink_efficiency`` of the links it has. On a direct-link node
        (``GpuProfile.nvlink_links``) those are what the slowest of the node's groups
        gets from the links between its members (they run at once, and the collective
        ends with its slowest group; a cluster using fewer GPUs per node than the board
        has uses its first ones); on a switched node, the GPU's whole NVLink."""
        g = self.cluster.gpu
        if g.nvlink_links and len(g.nvlink_links) < self.cluster.gpus_per_node:
            raise ShardingError(f"GPU profile {g.name!r} gives NVLink links for {len(g.nvlink_links)} GPUs per node "
                                f"but the cluster has {self.cluster.gpus_per_node} ({self.cluster})")
        bw = min(g.group_nvlink_bytes_per_s(m) for m in node_groups(group, self.cluster.gpus_per_node))
        bw *= g.nvlink_efficiency
        return g if bw == g.nvlink_bytes_per_s else dataclasses.replace(g, nvlink_bytes_per_s=bw)

    def link_class(self, axes, mesh) -> str:
        """"intra" (NVLink), "inter" (NIC) or "both" (hierarchical) for a group over ``axes``."""
        n, k = self.split(axes, mesh)
        return "intra" if k == n else "inter" if k == 1 else "both"

    def collective_time(self, wire_bytes: float, kind=None, axes=None, mesh=None) -> float:
        if not axes or mesh is None:   # a group nobody named: the slowest link
            lat, bw = self.cluster.gpu.nic_latency_s, self.cluster.gpu.nic_bytes_per_s
            latency, seconds = lat, wire_bytes / bw
        else:
            group = group_shape(tuple(axes), mesh)
            n, k = self._split(group)
            latency, seconds = SPANNING[self.cluster.collectives](kind or "all_reduce", wire_bytes, n, k,
                                                                  self._gpu_for(group))
        share = self.launch_share if kind in self.combined_kinds else 1.0
        return share * latency + seconds

    def step_time(self, step, mesh=None, axes_of=None) -> float:
        if step.kind == "slice":
            return 0.0
        axes = step.param("axes") if axes_of is None else axes_of(step)
        return self.collective_time(step.wire_bytes, step.kind, axes, mesh)

    def compute_time(self, flops: float, touched_bytes: float, contraction: bool = False, unit=None) -> float:
        """An op's seconds on one GPU: its arithmetic on the unit that does it
        (``cost.compute_unit``: tensor cores for a 16-bit matmul, at the measured fraction
        of peak for its size; the float32 matmul peak for a 32-bit one; the CUDA cores'
        float32 peak for the rest), never less than its bytes at the HBM bandwidth.
        Without a unit a contraction is taken as a 16-bit matmul."""
        g = self.cluster.gpu
        unit = unit or ("matmul" if contraction else "vector")
        if unit == "matmul":
            seconds = g.matmul_time(flops)
        elif unit == "matmul_fp32":
            seconds = g.matmul_time(flops, g.fp32_matmul_flops_per_s)
        else:
            seconds = flops / g.fp32_flops_per_s
        return max(seconds, touched_bytes / self.memory_bytes_per_s)


def as_cost_model(cost_model):
    """A ``Cluster`` becomes its ``ClusterCost``; anything else is returned as it is."""
    return cost_model.cost_model() if isinstance(cost_model, Cluster) else cost_model
