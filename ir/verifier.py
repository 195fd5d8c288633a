"""Structural checks of a Graph, run after every pass in tests.

What holds at every stage: SSA (each value defined once, before its uses), every
layout valid for its tensor on the mesh. After later passes more holds: every
op's operands arrive in the layouts its strategy needs (after insert-reshards),
no reshard remains (after reshard-to-collectives), every value has a local type
that is its global type cut by its layout (after localize).
"""
from __future__ import annotations

from .graph import CONSTRAINT, RESHARD, Graph, is_collective

STAGES = ("import", "bind-user-strategies", "propagate-sharding", "sink-reductions", "insert-reshards",
          "reshard-to-collectives", "localize")
# passes that fill another's slot in the pipeline and leave the graph as it does
# (mode="auto": the search gives every op a strategy, as propagation does)
SAME_STAGE = {"search-strategies": "propagate-sharding"}


class VerificationError(AssertionError):
    pass


def verify(graph: Graph, stage: str) -> None:
    slot = SAME_STAGE.get(stage, stage)
    if slot not in STAGES:
        raise ValueError(f"unknown stage {stage!r}")
    problems: list[str] = []
    _check(graph, STAGES.index(slot), problems)
    if problems:
        raise VerificationError(f"after {stage}:\n  " + "\n  ".join(problems))


def _check(graph: Graph, level: int, problems: list[str]) -> None:
    """Problems of one graph, then of the bodies of its loops and branches."""
    mesh = graph.mesh
    defined = {v.id for v in graph.inputs}
    for op in graph.ops:
        for v in op.inputs:
            if not v.is_literal and v.id not in defined:
                problems.append(f"{op.describe()}: operand {v} used before it is defined")
        for v in op.outputs:
            if v.id in defined:
                problems.append(f"{op.describe()}: value {v} defined twice")
            defined.add(v.id)
    for v in graph.outputs:
        if not v.is_literal and v.id not in defined:
            problems.append(f"output {v} is never defined")
    if level >= STAGES.index("propagate-sharding"):
        for v in graph.values():
            if v.is_literal:
                continue
            if v.layout is None:
                problems.append(f"value {v} has no layout")
                continue
            for p in v.layout.problems(v.type.shape, mesh):
                problems.append(f"value {v} layout {v.layout}: {p}")
        for op in graph.ops:
            if not is_collective(op) and op.kind != RESHARD and op.strategy is None:
                problems.append(f"{op.describe()}: no strategy")
    if level >= STAGES.index("insert-reshards"):
        for op in graph.ops:
            if op.kind == CONSTRAINT:
                problems.append(f"{op.describe()}: constraint left after insert-reshards")
            if is_collective(op) or op.kind == RESHARD:
                continue
            for n, v in enumerate(op.inputs):
                if v.is_literal:
                    continue
                need = op.strategy.operand_layout(n, v.type.rank, mesh)
                if v.layout != need:
                    problems.append(f"{op.describe()}: operand {n} is {v.layout} but the op needs {need}")
            for n, v in enumerate(op.outputs):
                if v.layout != op.strategy.result_layout(n, mesh):
                    problems.append(f"{op.describe()}: result {n} is {v.layout}, strategy makes "
                                    f"{op.strategy.result_layout(n, mesh)}")
        for v in graph.outputs:
            if v.layout is not None and v.layout.partial:
                problems.append(f"graph output {v} is still partial: {v.layout}")
    if level >= STAGES.index("reshard-to-collectives"):
        for op in graph.ops:
            if op.kind == RESHARD:
                problems.append(f"{op.describe()}: reshard left after reshard-to-collectives")
    if level >= STAGES.index("localize"):
        for v in graph.values():
            if v.is_literal:
                continue
            want = v.layout.local_shape(v.type.shape, mesh)
            if v.local_type is None or v.local_type.shape != want:
                problems.append(f"value {v}: local type {v.local_type}, expected shape {want}")
    for op in graph.ops:
        for body in op.subgraphs:
            _check(body, level, problems)
