"""Memory: the ``memory_limit`` a user writes, and when each value is alive.

The modeled peak per device is the largest, over program points, of the local
bytes of every value alive there: the function's arguments (parameters,
optimizer state, batch) for the whole step, every other value from the op that
makes it to its last reader (the saved activations of a training step are alive
from the forward to the backward that reads them), the outputs to the end; and at
each op, the copies redistributions make of its operands (a weight gathered for its
matmul lives while the matmul runs).
"""
from __future__ import annotations

import math
import re
from typing import Optional

from ...ir.errors import ShardingError
from ...ir.graph import Graph

_UNITS = {"": 1, "b": 1, "k": 10 ** 3, "kb": 10 ** 3, "m": 10 ** 6, "mb": 10 ** 6, "g": 10 ** 9, "gb": 10 ** 9,
          "t": 10 ** 12, "tb": 10 ** 12, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_memory_limit(limit) -> Optional[int]:
    """Bytes per device from an int or a text such as "12MB" or "16GiB"; None: no limit."""
    if limit is None:
        return None
    if isinstance(limit, bool):
        raise ShardingError(f"memory_limit={limit!r} is not a size: give bytes per device as an int, or text "
                            "such as '12MB' or '16GiB'")
    if isinstance(limit, (int, float)):
        if limit <= 0:
            raise ShardingError(f"memory_limit={limit!r} must be a positive number of bytes per device")
        return int(limit)
    if isinstance(limit, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", limit)
        unit = m.group(2).lower() if m else None
        if m and unit in _UNITS and float(m.group(1)) > 0:
            return int(float(m.group(1)) * _UNITS[unit])
        raise ShardingError(f"memory_limit={limit!r} is not a size: write a positive number and a unit, such as "
                            f"'12MB', '512MiB' or '16GiB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), or "
                            "give bytes per device as an int")
    raise ShardingError(f"memory_limit must be an int (bytes per device) or text such as '16GiB', "
                        f"not {type(limit).__name__}")


def live_intervals(graph: Graph) -> dict:
    """value -> (first program point it is alive at, last one); points are op positions,
    arguments are alive from -1, outputs to len(ops)."""
    end = len(graph.ops)
    out = {}
    for v in graph.inputs:
        out[v] = (-1, end)
    for t, op in enumerate(graph.ops):
        for v in op.outputs:
            out[v] = (t, t)
    for t, op in enumerate(graph.ops):
        for v in op.inputs:
            if v in out and out[v][0] >= 0:
                out[v] = (out[v][0], max(out[v][1], t))
    for v in graph.outputs:
        if v in out:
            out[v] = (out[v][0], end)
    return out


def local_bytes(v, layout, mesh) -> int:
    return math.prod(layout.local_shape(v.type.shape, mesh)) * v.type.itemsize


def plan_profile(graph: Graph, ops: dict, inputs: dict):
    """Modeled live bytes per device at each program point of a plan (op -> OpStrategy,
    input index -> Layout): the values alive there, plus, at each op, the copy a
    redistribution makes of an operand the op needs in another layout (a weight
    gathered for its matmul), alive at the op itself."""
    import numpy as np
    mesh = graph.mesh
    intervals = live_intervals(graph)
    diff = np.zeros(len(graph.ops) + 3)
    layout = {}

    def add(v, lay):
        layout[v] = lay
        if v in intervals:
            b, d = intervals[v]
            n = local_bytes(v, lay, mesh)
            diff[b + 1] += n
            diff[d + 2] -= n
    for i, lay in inputs.items():
        add(graph.inputs[i], lay)
    for t, op in enumerate(graph.ops):
        st = ops[op]
        for m, v in enumerate(op.inputs):
            have = layout.get(v)
            if have is None or v.literal is not None:
                continue
            need = st.operand_layout(m, v.type.rank, mesh)
            if need != have:
                n = local_bytes(v, need, mesh)
                diff[t + 1] += n
                diff[t + 2] -= n
        for k, v in enumerate(op.outputs):
            add(v, st.result_layout(k, mesh))
    return np.cumsum(diff)[:len(graph.ops) + 2]


def plan_peak(graph: Graph, ops: dict, inputs: dict) -> float:
    """The modeled live peak, bytes per device, of a plan (``plan_profile``'s largest)."""
    return float(plan_profile(graph, ops, inputs).max())
