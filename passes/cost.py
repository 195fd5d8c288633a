"""What a step costs: time on the wire plus time computing.

Counting only bytes is a trap (see DESIGN.md): a plan that gathers an activation
and repeats a matmul on every rank moves fewer bytes than Megatron's, yet is
slower. So communication and compute are both priced in seconds. The defaults
describe one modern GPU node; only their ratios steer decisions.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    latency_s: float = 5e-6          # fixed cost of one collective
    link_bytes_per_s: float = 100e9  # per-device collective bandwidth
    flops_per_s: float = 200e12      # dense matmul throughput per device
    memory_bytes_per_s: float = 2e12  # HBM bandwidth, for memory-bound ops

    def collective_time(self, wire_bytes: float) -> float:
        return self.latency_s + wire_bytes / self.link_bytes_per_s

    def compute_time(self, flops: float, touched_bytes: float) -> float:
        return max(flops / self.flops_per_s, touched_bytes / self.memory_bytes_per_s)


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
