"""One plan writer, and one set of origin words.

``write_plan`` puts a plan into the graph: each input's layout, each op's strategy
and origin (and the op that origin names, so a report can follow the chain back
to the user's mark), each result's layout. Both engines write through it.

Origin words, what every op reports as the reason for its strategy:
- ``user``: the user fixed it (a ``shard()`` mark, an op inside a marked region; a
  ``shard_map`` says ``user (shard_map in_specs/out_specs)``), in every mode;
- ``in_strategy of input x`` / ``out_strategy of output i``: where a chain of
  propagated choices starts at an argument or output the user laid out;
- propagated: ``forward from <op at file:line>``, ``backward from ...``, ``from ...``
  (``propagated``), ``default`` where no neighbour said anything;
- searched (``mode="auto"``): ``auto (searched)`` for a decision of the search,
  ``auto (follows <op at file:line>)`` / ``auto (follows input x)`` for an op whose
  strategy is read off the decision it follows.
Words are put together only when first read (``Op.origin`` takes a lookup).
"""
from __future__ import annotations

import functools

from ...ir.graph import CONSTRAINT, Graph, Op

USER = "user"
DEFAULT = "default"
SEARCHED = "auto (searched)"


def write_plan(graph: Graph, inputs: dict, placed) -> None:
    """``inputs``: input index -> Layout; ``placed``: in program order, per op (op,
    strategy, origin words or a lookup, the op the origin names or None, its result
    layouts or None to read them off the strategy). Each op is written before the
    next is taken, so an iterator may read the layouts written so far."""
    mesh = graph.mesh
    for i, layout in inputs.items():
        graph.inputs[i].layout = layout
    for op, st, words, via, results in placed:
        op.strategy, op.origin, op.origin_op = st, words, via
        if results is None:
            results = [st.result_layout(k, mesh) for k in range(len(op.outputs))]
        for v, layout in zip(op.outputs, results):
            v.layout = layout


def user_fixed(op: Op) -> bool:
    """Whether the user fixed ``op``'s layout: a mark, or an op inside a marked region."""
    return op.kind == CONSTRAINT and op.pinned is not None or op.region is not None


def in_strategy(name: str) -> str:
    return f"in_strategy of input {name}"


def out_strategy(i: int) -> str:
    return f"out_strategy of output {i}"


def describe_op(op: Op, regions: dict) -> str:
    """An op as origins name it: ``kind at file:line`` (a shard() mark: its call)."""
    kind = op.kind
    if op.kind == CONSTRAINT and op.region is not None and op.region in regions:
        kind = regions[op.region].describe()
    return f"{kind} at {op.source}" if op.source else kind


def _propagated_words(origin: tuple, regions: dict) -> str:
    side, how, who = origin
    if isinstance(who, Op):
        who = describe_op(who, regions)
    if side == "result" or how == "consumer":
        return f"backward from {who}"
    if how == "producer":
        return f"forward from {who}"
    return f"from {who}"


def propagated(origin, regions: dict):
    """A propagated choice's origin: words as they are (``user``, ``default``), or for
    (side, how, who) a lookup that words it when first read."""
    if isinstance(origin, str):
        return origin
    return functools.partial(_propagated_words, origin, regions)


def follows_input(graph: Graph, i: int) -> str:
    return f"auto (follows input {graph.input_names[i] if i < len(graph.input_names) else i})"


def follows(root: Op):
    def words():
        return f"auto (follows {root.kind} at {root.source})" if root.source else f"auto (follows {root.kind})"
    return words
