"""IR dump files: one global file per pass, one program per rank, a summary, and
the plan as data (``plan.json``, what ``shardprop report DIR`` draws)."""
from __future__ import annotations

import os
from collections import defaultdict

from ..ir.graph import COLLECTIVE_KINDS, Graph, is_collective
from ..ir.printer import print_graph
from .plan_data import write_plan_json


def summary_text(graph: Graph) -> str:
    """Collectives by kind: how many, and bytes each device sends per step."""
    by_kind = defaultdict(lambda: [0, 0])
    lines = [f"# shardprop summary; mesh {graph.mesh} ({graph.mesh.size} devices)", ""]
    for _, op in graph.walk_ops():
        if is_collective(op):
            by_kind[op.kind][0] += 1
            by_kind[op.kind][1] += op.params.get("wire_bytes", 0)
    lines.append(f"{'kind':<16}{'count':>8}{'bytes/device/step':>20}")
    for kind in COLLECTIVE_KINDS:
        if kind in by_kind:
            n, b = by_kind[kind]
            lines.append(f"{kind:<16}{n:>8}{b:>20}")
    total = sum(b for _, b in by_kind.values())
    lines.append(f"{'total':<16}{sum(n for n, _ in by_kind.values()):>8}{total:>20}")
    lines.append("")
    lines.append("collectives in program order (those in loop bodies run once per iteration):")
    for _, op in graph.walk_ops():
        if is_collective(op):
            p = {k: v for k, v in op.params.items() if k not in ("wire_bytes", "pairs")}
            lines.append(f"  {op.kind:<15} {op.inputs[0].local_type} -> {op.outputs[0].local_type} "
                         f"{p} bytes={op.params.get('wire_bytes', 0)} {op.note}")
    return "\n".join(lines) + "\n"


def write_dumps(dump_dir: str, graph: Graph, pass_texts: dict, ranks=None, write_global: bool = True) -> None:
    """Write ``NN_<pass>.ir``, ``rank_<r>/execute.ir`` for each rank, ``summary.txt`` and ``plan.json``.
    ``ranks`` limits the per-rank files to the ranks this process owns; ``write_global``
    says whether this process writes the files common to all ranks."""
    os.makedirs(dump_dir, exist_ok=True)
    for name, text in (pass_texts.items() if write_global else ()):
        with open(os.path.join(dump_dir, name), "w") as f:
            f.write(text)
    for r in (range(graph.mesh.size) if ranks is None else ranks):
        d = os.path.join(dump_dir, f"rank_{r}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "execute.ir"), "w") as f:
            f.write(print_graph(graph, rank=r, title=f"program executed by rank {r}"))
    if write_global:
        with open(os.path.join(dump_dir, "summary.txt"), "w") as f:
            f.write(summary_text(graph))
        write_plan_json(dump_dir, graph)
