"""Memory: the ``memory_limit`` a user writes, and when each value is alive.

The modeled peak per device is the largest, over program points, of the local
bytes of every value alive there, counted as XLA allocates them (what
``memory_analysis()`` of the compiled program adds up: arguments + outputs +
temp - aliased): the function's arguments (parameters, optimizer state, batch)
and its outputs for the whole step (the caller's buffers, and output buffers
allocated beside the scratch for the whole run), except an output returned in
place of a donated argument, which XLA writes into that argument's buffer; every
other value from the op that makes it to its last reader (the saved activations
of a training step are alive from the forward to the backward that reads them),
except a transpose, a reshape or a mark's sharding constraint, which XLA writes
into its operand's buffer (``views``) and which is counted only where that buffer is
not alive already, and an elementwise value fused into its one reader's loop
(``fused_away``), which holds no buffer (its operands live to that reader instead);
and at each op, the copies redistributions make of its operands (a weight
gathered for its matmul lives while the matmul runs: insert-reshards gives each
use of an argument stored split its own gather, kept at the use by a tie, so
none is shared by the forward and the backward).

XLA's own schedule, layout copies and packing are not modeled (packing alone makes
the compiled peak 1.02-1.29x XLA's own live peak on the GPT steps of
``bench/memory_model.py``): the compiled program is checked against the limit after
planning (``compiler/memory_check.py``).
"""
from __future__ import annotations

import math
import re
from typing import Optional

from ...ir.errors import ShardingError
from ...ir.graph import CONSTRAINT, Graph
from ..fusion import unwritten_values
from ..insert_reshards import gathers, stored_values
from ..redistribute import plan_redistribution

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
    arguments and outputs are alive from -1 to len(ops); an output in a donated
    argument's buffer has no interval of its own, and a view of another value's buffer
    (``views``) none where that buffer is alive anyway."""
    return _intervals(graph)[0]


def view_shadows(graph: Graph) -> dict:
    """position of a view's op -> (first, last) program points where the view is not
    counted as a value of its own, its buffer being alive anyway: there it holds bytes
    only if its operand was redistributed for it (a new buffer; ``plan_profile``)."""
    return _intervals(graph)[1]


def _intervals(graph: Graph) -> tuple[dict, dict]:
    residents = fused_away(graph)
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
    for t in range(len(graph.ops) - 1, -1, -1):     # later readers first: a chain's inputs reach its end
        op = graph.ops[t]
        for v in op.outputs:
            if v in residents and v in out:
                d = out.pop(v)[1]
                for u in op.inputs:
                    if u in out and u.literal is None:
                        out[u] = (out[u][0], max(out[u][1], d))
    in_place = in_donated_buffers(graph)
    for v in graph.outputs:
        if v not in out:
            continue
        if v in in_place and out[v][0] >= 0:
            del out[v]            # counted as the donated argument it overwrites
        else:
            out[v] = (-1, end)
    held, shadows = {}, {}    # buffer -> the last point one of its values is alive at so far
    for v, (t, buf) in views(graph, residents).items():      # in program order
        if v not in out:
            continue
        until = held.get(buf, out[buf][1] if buf in out else end)    # (not in: in a donated buffer)
        b, d = out[v]
        if b + 1 <= min(d, until):      # (at its op, a redistribution's copy is the view's buffer)
            shadows[t] = (b + 1, min(d, until))
        if d <= until:
            del out[v]        # its buffer is alive anyway
        else:
            out[v] = (max(b, until + 1), d)
        held[buf] = max(until, d)
    return out, shadows


VIEW_KINDS = frozenset({"transpose", "reshape", CONSTRAINT})


def fused_away(graph: Graph) -> frozenset:
    """The values that hold no buffer because fusion computes them inside their one
    reader's loop (``fusion.unwritten_values``): an elementwise chain's intermediates.
    Their operands are alive to that reader instead (``live_intervals``). A view keeps
    its own rule (``views``)."""
    made_by_views = {v for op in graph.ops if op.kind in VIEW_KINDS for v in op.outputs}
    return unwritten_values(graph) - made_by_views


def views(graph: Graph, residents=None) -> dict:
    """value -> (position of its op, the earlier value whose buffer it is): the result of a transpose or a
    reshape, which XLA writes as a bitcast of its operand's buffer (layout assignment
    picks the operand's layout) or folds into its reader (a transpose into a dot's
    dimension numbers). ``live_intervals`` counts a view only where no value of its
    buffer is alive already: a transpose of a weight costs nothing, and a value read
    only through its view is counted once. (Where the view's operand is redistributed
    first, the view reads a new buffer: while the operand is alive too, that one is
    counted only at the op, as its redistribution's copy.) A view the function returns
    is its own output buffer."""
    returned = set(graph.outputs)
    residents = fused_away(graph) if residents is None else residents
    out: dict = {}
    for t, op in enumerate(graph.ops):
        if op.kind in VIEW_KINDS and len(op.inputs) == 1 and len(op.outputs) == 1:
            v, w = op.inputs[0], op.outputs[0]
            if v.literal is None and w not in returned and w not in residents and v not in residents:
                out[w] = (t, out[v][1] if v in out else v)
    return out


def fused_reads(graph: Graph) -> list:
    """(position of the reader, the operand's index there, position of its producer) of
    every read of a fused value (``fused_away``). Where the reader needs the value in
    another layout, XLA writes it and redistributes it, so there the value holds its
    bytes from its producer to that reader (``fused_bytes``, in ``plan_buffers`` and the
    search's rows alike)."""
    gone = fused_away(graph)
    made = {v: t for t, op in enumerate(graph.ops) for v in op.outputs if v in gone}
    return [(r, m, made[v]) for r, op in enumerate(graph.ops) for m, v in enumerate(op.inputs) if v in made]


def fused_bytes(v, have, need, mesh) -> float:
    """Bytes per device a fused value holds up to its reader: none where the reader reads
    it in the layout it is made in (it stays in the fused loop), else all of it."""
    return 0.0 if have == need else float(local_bytes(v, have, mesh))


def view_bytes(v, have, need, mesh) -> float:
    """Bytes per device a view of ``v`` holds where its buffer is alive anyway: none if
    ``v`` is read in the layout it has, else the redistribution's result (a new buffer)."""
    return 0.0 if have == need else float(local_bytes(v, need, mesh))


def in_donated_buffers(graph: Graph) -> set:
    """The outputs XLA writes into a donated argument's buffer: those tied to a donated
    argument (a tie makes the layouts, so the local shapes, equal), unless the same
    value is also returned untied."""
    tied = {graph.outputs[i] for i, j in graph.tied_outputs.items() if j in graph.donated_inputs}
    untied = {v for i, v in enumerate(graph.outputs) if graph.tied_outputs.get(i) not in graph.donated_inputs}
    return tied - untied


def local_bytes(v, layout, mesh) -> int:
    return math.prod(layout.local_shape(v.type.shape, mesh)) * v.type.itemsize


def copy_bytes(v, have, need, mesh) -> float:
    """Bytes per device a redistribution of ``v`` from ``have`` to ``need`` holds beside
    ``v`` while it runs, as XLA lowers the planner's steps (read from the CPU buffer
    assignments of Adam and SGD MLP steps): each step's result, twice where XLA makes
    it in another layout and copies it back (an all_gather along a dim with a split
    dim before it gathers along the major dim, then transposes; an all_to_all sends
    slices and concatenates what it receives), plus the step's input where that is
    an earlier step's result. The largest over the steps."""
    if have == need:
        return 0.0
    try:
        steps = plan_redistribution(tuple(v.type.shape), v.type.itemsize, have, need, mesh)
    except ValueError:    # no way there (a partial from a whole value): the search never picks it
        steps = ()
    if not steps:
        return float(local_bytes(v, need, mesh))
    most, held = 0.0, 0.0
    for s in steps:
        out = local_bytes(v, s.after, mesh)
        twice = s.kind == "all_to_all" or (s.kind == "all_gather" and any(
            n > 1 for n in s.after.local_shape(v.type.shape, mesh)[:s.param("dim", 0)]))
        most = max(most, held + out * (2 if twice else 1))
        held = out
    return float(most)


def program_facts(graph: Graph) -> tuple:
    """What ``plan_buffers`` needs of the program that no plan changes: (live intervals,
    view shadows, fused reads by (reader, operand) -> producer, the values insert-reshards
    gathers per use: ``insert_reshards.stored_values``). A caller that prices
    many plans of one program (the search: ~100 peaks per search, each of which
    recomputed them, fusion's analysis included, a third of a peak's time) computes
    them once."""
    intervals, shadows = _intervals(graph)
    return intervals, shadows, {(r, m): p for r, m, p in fused_reads(graph)}, frozenset(stored_values(graph))


def plan_buffers(graph: Graph, ops: dict, inputs: dict, facts: Optional[tuple] = None) -> list:
    """The buffers a plan (op -> OpStrategy, input index -> Layout) holds, as
    (first profile index, last profile index, bytes per device): every value over its
    live interval, and, at each op, the copy a redistribution makes of an operand the
    op needs in another layout (a weight gathered for its matmul, ``copy_bytes``), alive
    at the op itself. A layout request (a mark) that gathers an argument holds nothing
    itself: each reader of its result gathers the argument at its own use, as
    insert-reshards writes it. Profile index: op position + 1; 0 and len(ops) + 1 are
    the call's start and end (the arguments and outputs span them)."""
    mesh = graph.mesh
    intervals, shadows, fused, stored = program_facts(graph) if facts is None else facts
    out = []
    layout = {}

    def add(v, lay):
        layout[v] = lay
        if v in intervals:
            b, d = intervals[v]
            out.append((b + 1, d + 1, local_bytes(v, lay, mesh)))
    for i, lay in inputs.items():
        add(graph.inputs[i], lay)
    at_use = {}     # a request's result that each reader gathers itself -> (the stored value)
    for t, op in enumerate(graph.ops):
        st = ops[op]
        if op.kind == CONSTRAINT and op.inputs[0] in stored and op.inputs[0] in layout:
            v, request = op.inputs[0], st.result_layout(0, mesh)
            if gathers(v, layout[v], request, mesh):
                # a request that gathers a stored value: each reader of its result gathers
                # the value itself, at its own use (insert-reshards), so nothing is held here
                at_use[op.outputs[0]] = v
                layout[op.outputs[0]] = request
                continue
        for m, v in enumerate(op.inputs):
            have = layout.get(v)
            if have is None or v.literal is not None:
                continue
            need = st.operand_layout(m, v.type.rank, mesh)
            if v in at_use:     # its own gather to the request's layout, then on to what the op needs
                u = at_use[v]
                held = copy_bytes(u, layout[u], have, mesh)
                if need != have:
                    held = max(held, local_bytes(v, have, mesh) + copy_bytes(v, have, need, mesh))
                out.append((t + 1, t + 1, held))
                continue
            if need != have:
                out.append((t + 1, t + 1, copy_bytes(v, have, need, mesh)))
            if t in shadows:
                b, d = shadows[t]
                out.append((b + 1, d + 1, view_bytes(v, have, need, mesh)))
            if (t, m) in fused:
                out.append((fused[t, m] + 1, t + 1, fused_bytes(v, have, need, mesh)))
        for k, v in enumerate(op.outputs):
            add(v, st.result_layout(k, mesh))
    return out


def plan_profile(graph: Graph, ops: dict, inputs: dict, facts: Optional[tuple] = None):
    """Modeled live bytes per device at each program point of a plan: the sum of
    ``plan_buffers`` alive there (``facts``: the program's ``program_facts``, where known)."""
    import numpy as np
    diff = np.zeros(len(graph.ops) + 3)
    for b, d, n in plan_buffers(graph, ops, inputs, facts):
        diff[b] += n
        diff[d + 1] -= n
    return np.cumsum(diff)[:len(graph.ops) + 2]


def plan_peak(graph: Graph, ops: dict, inputs: dict) -> float:
    """The modeled live peak, bytes per device, of a plan (``plan_profile``'s largest)."""
    return float(plan_profile(graph, ops, inputs).max())


def largest_at_peak(graph: Graph, ops: dict, inputs: dict, n: int = 5) -> list:
    """(name, global shape, local bytes) of the ``n`` largest values alive where the
    plan's modeled peak is (arguments by their names): what an error names."""
    at = int(plan_profile(graph, ops, inputs).argmax())    # profile index: op position + 1
    mesh = graph.mesh
    layout = dict(((graph.inputs[i], lay) for i, lay in inputs.items()))
    for op in graph.ops:
        for k, v in enumerate(op.outputs):
            layout[v] = ops[op].result_layout(k, mesh)
    names = {v: (graph.input_names[i] if i < len(graph.input_names) else f"input {i}")
             for i, v in enumerate(graph.inputs)}
    alive = [(names.get(v, f"a {v.type.dtype} value"), tuple(v.type.shape), float(local_bytes(v, layout[v], mesh)))
             for v, (b, d) in live_intervals(graph).items() if b + 1 <= at <= d + 1 and v in layout]
    return sorted(alive, key=lambda t: -t[2])[:n]
