"""The plan: what the compiler decided, as plain data.

``plan.ops``: the traced operators in program order with their strategies
(split counts per dim, one tuple per operand), where each strategy came from,
and the user's source line. ``plan.collectives``: every inserted redistribution
with its kind, rank groups, per-device shapes and bytes. ``plan.dump(dir)``
writes the same files as ``parallelize(..., dump_dir=dir)``. ``plan.to_html(path)``
writes the plan report (one self-contained page), ``plan.explain(x)`` its panel for
an op, a source line or a collective, as text; both read ``plan.data``, the plan as
JSON data (the dump's ``plan.json``).
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

from ..ir.graph import Graph, is_collective
from ..ir.mesh import Mesh
from ..runtime.dump import summary_text, write_dumps
from ..runtime.plan_data import plan_data
from . import explain as _explain
from .report import render_html, write_html


@dataclass(frozen=True)
class PlanOp:
    primitive: str
    in_strategy: tuple
    out_strategy: tuple
    origin: str
    source: str
    in_layouts: tuple
    out_layouts: tuple

    def __str__(self):
        return f"{self.primitive:<20} {str(self.in_strategy):<28} -> {str(self.out_strategy):<14} {self.origin}  ({self.source})"


@dataclass(frozen=True)
class PlanCollective:
    kind: str
    axes: tuple
    groups: tuple
    in_shape: tuple
    out_shape: tuple
    dtype: str
    bytes: int
    reason: str
    source: str

    def __str__(self):
        g = " ".join("-".join(map(str, grp)) for grp in self.groups)
        return f"{self.kind:<15} {self.in_shape} -> {self.out_shape} groups={g} bytes={self.bytes} {self.reason}"


class Plan:
    def __init__(self, graph: Graph, pass_texts: dict, pass_seconds: dict, trace_seconds: float,
                 regenerate_texts=None):
        self.graph = graph
        self.mesh: Mesh = graph.mesh
        self.pass_texts = pass_texts
        self._regenerate_texts = regenerate_texts  # printing every pass is slow: done on demand
        self.pass_seconds = dict(pass_seconds)
        self.trace_seconds = trace_seconds

    # Worked out when first asked: a program that only runs never reads them (and
    # every op's source line and origin would be looked up for them).
    @functools.cached_property
    def ops(self) -> tuple:
        return tuple(self._ops(self.graph))

    @functools.cached_property
    def collectives(self) -> tuple:
        return tuple(self._collectives(self.graph))

    def _ops(self, graph: Graph):
        mesh = graph.mesh
        for _, op in graph.walk_ops():
            if is_collective(op):
                continue
            ins = tuple(op.strategy.operand_layout(n, v.type.rank, mesh) for n, v in enumerate(op.inputs))
            outs = tuple(op.strategy.result_layout(n, mesh) for n in range(len(op.outputs)))
            yield PlanOp(op.kind, tuple(l.splits(mesh) for l in ins), tuple(l.splits(mesh) for l in outs),
                         op.origin, op.source or "", tuple(map(str, ins)), tuple(map(str, outs)))

    def _collectives(self, graph: Graph):
        mesh = graph.mesh
        for _, op in graph.walk_ops():
            if not is_collective(op):
                continue
            if op.kind == "permute":
                axes, groups = mesh.axis_names, tuple((s, d) for s, d in op.params["pairs"] if s != d)
            elif op.kind == "slice":
                axes = tuple(a for _, ax in op.params["cuts"] for a in ax)
                groups = mesh.groups(axes)
            else:
                axes = tuple(op.params["axes"])
                groups = mesh.groups(axes)
            yield PlanCollective(op.kind, axes, groups, op.inputs[0].local_type.shape,
                                 op.outputs[0].local_type.shape, op.inputs[0].type.dtype,
                                 int(op.params.get("wire_bytes", 0)), op.note, op.source or "")

    @functools.cached_property
    def data(self) -> dict:
        """The plan as JSON-ready data (schema: runtime/plan_data.py): what the report
        draws and what a dump's ``plan.json`` holds."""
        return plan_data(self.graph)

    def to_html(self, path=None) -> str:
        """Write the plan report to ``path`` (one HTML file that opens from disk, no
        server); without a path, return the page."""
        return render_html(self.data) if path is None else write_html(self.data, str(path))

    @property
    def cost(self):
        """mode="auto": the modeled step (time, bytes moved, peak memory, compute per
        device, a breakdown by operator, the solver's figures); None in other modes."""
        return self.graph.auto

    def explain(self, x=None) -> str:
        """The report's panel as text for ``x``: an op (a ``PlanOp`` of ``plan.ops`` or
        its index there), a source line (``"net.py:7"``: every op from it), or a
        collective (a ``PlanCollective`` of ``plan.collectives``). Without ``x``, for a
        mode="auto" plan: each matmul/conv decision, its chosen strategy, and the best
        rejected one with what the plan would have cost with it."""
        if x is None:
            return _explain.search_text(self.graph.auto)
        data = self.data
        if isinstance(x, PlanCollective):
            return _explain.collective_text(data, _position(self.collectives, x, "plan.collectives"))
        if isinstance(x, PlanOp):
            return _explain.op_text(data, data["plan_ops"][_position(self.ops, x, "plan.ops")])
        if isinstance(x, int) and not isinstance(x, bool):
            if not -len(self.ops) <= x < len(self.ops):
                raise IndexError(f"plan has {len(self.ops)} operators; op index {x} is out of range")
            return _explain.op_text(data, data["plan_ops"][x])
        if isinstance(x, str):
            return _explain.source_text(data, x)
        raise TypeError(f"explain takes a PlanOp, an index into plan.ops, a source line such as 'net.py:7' "
                        f"or a PlanCollective, not {type(x).__name__}")

    def count(self, kind: str) -> int:
        return sum(1 for c in self.collectives if c.kind == kind)

    def counts(self) -> dict:
        return dict(Counter(c.kind for c in self.collectives))

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.collectives)

    def summary(self) -> str:
        return summary_text(self.graph)

    def dump(self, dump_dir: str, ranks=None, write_global: bool = True, dump_ranks=None) -> None:
        """Write the dump files (``runtime/dump.py``); ``dump_ranks``: the ranks whose
        ``rank_<r>/execute.ir`` is written (default: every rank up to
        ``RANK_FILES_UP_TO`` ranks; beyond, none: the rank classes hold them all)."""
        if not self.pass_texts and self._regenerate_texts is not None and write_global:
            self.pass_texts = self._regenerate_texts()
        write_dumps(dump_dir, self.graph, self.pass_texts, ranks, write_global, dump_ranks)
        if self.graph.auto is not None and write_global:   # mode="auto": what the search chose and why
            import os
            with open(os.path.join(dump_dir, "search.txt"), "w") as f:
                f.write(_explain.search_text(self.graph.auto) + "\n")

    def __str__(self):
        lines = [f"plan on mesh {self.mesh} ({self.mesh.size} devices)", "operators:"]
        lines += ["  " + str(o) for o in self.ops]
        lines.append("collectives:")
        lines += ["  " + str(c) for c in self.collectives] or ["  (none)"]
        return "\n".join(lines)


def _position(items: tuple, x, where: str) -> int:
    """Where ``x`` is in ``items``: that very object (equal ops of two layers compare
    equal), else the first equal one."""
    for k, item in enumerate(items):
        if item is x:
            return k
    try:
        return items.index(x)
    except ValueError:
        raise ValueError(f"{x} is not in {where} of this plan") from None
