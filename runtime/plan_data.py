"""The plan as JSON data: what ``plan.json`` in a dump folder holds, and what the
HTML report is drawn from (``plan.to_html`` and ``shardprop report DIR`` read the
same data, so they make the same page).

Schema ``shardprop.plan/1`` (every index is into a list of the same document)::

    program       the function's name
    mesh          {axes: [name], sizes: [int], devices: N, coords: [[coord per axis] per rank]}
    strings       [str]: sources, origins, notes and params, each stored once
    types         [{shape: [int], dtype}]
    layouts       [{dims: [[axis, major first] per tensor dim], partial: [axis], partial_op}]
    group_sets    [[[rank]]]: the rank groups of a collective over some axes (or permute pairs)
    values        [{type, layout, local, name, literal?, const?}]: type/layout/local index
                  types/layouts (local: the per-rank type after localize); name as in the .ir dumps
    graphs        [{name, parent (op), inputs: [value], outputs: [value], ops: [op],
                    repeats: [{start, period, count, inner?}] (positions in ops),
                    trip_count (a scan body: iterations per step)}]
    ops           [{kind, graph, in: [value], out: [value], in_layouts, out_layouts (layout per
                    operand / result, null for a literal operand), source, origin, from, via?,
                    note?, params?, subgraphs?, collective?}] in program order (a loop's body
                    right after the loop op); source/origin/note/params index strings; ``from``
                    is the op whose choice ``origin`` names (null when none is in the
                    program); ``via`` the origins of ops on that chain that the program no
                    longer holds (a shard() mark's constraint), in order
    collectives   [{op, kind, axes, groups, in_shape, out_shape, dtype, bytes, reason, source,
                    params}] in program order, as ``plan.collectives``: groups indexes
                    group_sets; shapes are per device; bytes are sent per device per run
    plan_ops      [op]: ``plan.ops[i]`` is ``ops[plan_ops[i]]`` (every op but the collectives)
    alternatives  null: propagation keeps only the chosen candidate, not the ones it rejected

Values are the program's edges: an op's ``in`` names the values it reads, and the
op whose ``out`` holds a value made it (none: a graph input, or a literal).
"""
from __future__ import annotations

import json
import os
from typing import Optional

from ..ir.graph import Graph, Op, Value, is_collective
from ..ir.printer import Namer, fmt, fmt_params
from ..ir.repeats import find_repeats

SCHEMA = "shardprop.plan/1"
FILE_NAME = "plan.json"


class _Table:
    """Each distinct item stored once; its position is its id."""

    def __init__(self):
        self.items, self.ids = [], {}

    def __call__(self, key, make=None):
        i = self.ids.get(key)
        if i is None:
            i = self.ids[key] = len(self.items)
            self.items.append(key if make is None else make())
        return i


class _Builder:
    def __init__(self, graph: Graph):
        self.root = graph
        self.mesh = graph.mesh
        self.strings, self.types, self.layouts, self.groups = _Table(), _Table(), _Table(), _Table()
        self.values: list = []
        self.value_ids: dict = {}
        self.ops: list = []
        self._op_objects: list = []   # the Op of each entry of ops
        self.op_ids: dict = {}
        self.graphs: list = []
        self.collectives: list = []
        self.namer = Namer(graph)

    def string(self, s: Optional[str]):
        return None if not s else self.strings(s)

    def type(self, t):
        if t is None:
            return None
        return self.types(t, lambda: {"shape": list(t.shape), "dtype": t.dtype})

    def layout(self, layout):
        if layout is None:
            return None
        return self.layouts(layout, lambda: {"dims": [list(d) for d in layout.dims], "partial": list(layout.partial),
                                             "partial_op": layout.partial_op})

    def value(self, v: Value, define: bool) -> int:
        i = self.value_ids.get(v.id)
        if i is not None:
            return i
        # named as the printer names it, in the same order, so the page and the .ir files agree
        name = self.namer.define(v) if define else self.namer.use(v)
        entry = {"type": self.type(v.type), "layout": None if v.is_literal else self.layout(v.layout),
                 "local": self.type(v.local_type), "name": name}
        if v.is_literal:
            entry["literal"] = name.split(":")[0]
        if v.const is not None:
            entry["const"] = True
        i = self.value_ids[v.id] = len(self.values)
        self.values.append(entry)
        return i

    def walk(self, graph: Graph, parent: Optional[int], define_inputs: bool) -> int:
        gi = len(self.graphs)
        g = {"name": graph.name, "parent": parent, "inputs": [self.value(v, define_inputs) for v in graph.inputs],
             "outputs": [], "ops": []}
        self.graphs.append(g)
        if parent is not None:
            owner = self.ops[parent]
            if owner["kind"] == "scan":
                g["trip_count"] = self._param(parent, "length")
        for op in graph.ops:
            oi = self.op(op, gi)
            g["ops"].append(oi)
            for body in op.subgraphs:
                self.ops[oi].setdefault("subgraphs", []).append(self.walk(body, oi, True))
        g["outputs"] = [self.value(v, False) for v in graph.outputs]
        return gi

    def _param(self, oi: int, name: str):
        v = self._op_objects[oi].params.get(name)
        return int(v) if isinstance(v, int) else None

    def op(self, op: Op, gi: int) -> int:
        oi = len(self.ops)
        self.op_ids[id(op)] = oi
        self._op_objects.append(op)
        mesh = self.mesh
        ins = [self.value(v, False) for v in op.inputs]
        outs = [self.value(v, True) for v in op.outputs]
        entry = {"kind": op.kind, "graph": gi, "in": ins, "out": outs,
                 "source": self.string(op.source), "origin": self.string(op.origin or "default"), "from": None}
        if is_collective(op):
            entry["in_layouts"] = [self.layout(v.layout) for v in op.inputs]
            entry["out_layouts"] = [self.layout(v.layout) for v in op.outputs]
            entry["collective"] = self.collective(op, oi)
        else:
            st = op.strategy
            entry["in_layouts"] = [None if v.is_literal or st is None else
                                   self.layout(st.operand_layout(n, v.type.rank, mesh))
                                   for n, v in enumerate(op.inputs)]
            entry["out_layouts"] = [None if st is None else self.layout(st.result_layout(n, mesh))
                                    for n in range(len(op.outputs))]
            params = fmt_params(op.params)
            if params:
                entry["params"] = self.string(params)
        if op.note:
            entry["note"] = self.string(op.note)
        self.ops.append(entry)
        return oi

    def collective(self, op: Op, oi: int) -> int:
        mesh, p = self.mesh, op.params
        if op.kind == "permute":
            axes = list(mesh.axis_names)
            pairs = tuple((s, d) for s, d in p["pairs"] if s != d)
            groups = self.groups(("pairs", pairs), lambda: [list(x) for x in pairs])
        else:
            axes = [a for _, ax in p["cuts"] for a in ax] if op.kind == "slice" else list(p["axes"])
            groups = self.groups(("axes", tuple(axes)), lambda: [list(g) for g in mesh.groups(axes)])
        params = {k: _plain(v) for k, v in sorted(p.items()) if k != "wire_bytes"}
        src, dst = op.inputs[0], op.outputs[0]
        ci = len(self.collectives)
        self.collectives.append({"op": oi, "kind": op.kind, "axes": axes, "groups": groups,
                                 "in_shape": list(src.local_type.shape), "out_shape": list(dst.local_type.shape),
                                 "dtype": src.type.dtype, "bytes": int(p.get("wire_bytes", 0)),
                                 "reason": op.note or "", "source": op.source or "", "params": params})
        return ci

    def link_origins(self) -> None:
        """``from``: the op an origin names, where the program still holds it; the
        origins of ops on the way that it no longer holds (a shard() mark's
        constraint) go to ``via``."""
        for oi, op in enumerate(self._op_objects):
            via, cur, seen = [], op.origin_op, {id(op)}
            while cur is not None and id(cur) not in self.op_ids and id(cur) not in seen:
                seen.add(id(cur))
                via.append(self.strings(cur.origin or "default"))
                cur = cur.origin_op
            if cur is not None and id(cur) in self.op_ids:
                self.ops[oi]["from"] = self.op_ids[id(cur)]
            elif self._loop_boundary(op):
                self.ops[oi]["from"] = self.graphs[self.ops[oi]["graph"]]["parent"]
            if via:
                self.ops[oi]["via"] = via

    def _loop_boundary(self, op: Op) -> bool:
        return op.origin_op is None and "loop boundary" in (op.origin or "")

    def repeats(self) -> None:
        tokens = _Table()
        for g in self.graphs:
            seq = [tokens(self._token(oi)) for oi in g["ops"]]
            g["repeats"] = [r.to_json() for r in find_repeats(seq)]

    def _token(self, oi: int) -> tuple:
        """Equal for the same op of two repetitions of a layer."""
        e = self.ops[oi]
        vt = [self.values[v]["type"] for v in e["in"]] + [self.values[v]["type"] for v in e["out"]]
        return (e["kind"], e["source"], tuple(e["in_layouts"]), tuple(e["out_layouts"]), tuple(vt),
                e.get("params"), e.get("note"), len(e.get("subgraphs", ())))

    def build(self) -> dict:
        self.walk(self.root, None, False)
        self.link_origins()
        self.repeats()
        mesh = self.mesh
        return {
            "schema": SCHEMA,
            "program": self.root.name,
            "mesh": {"axes": list(mesh.axis_names), "sizes": list(mesh.axis_sizes), "devices": mesh.size,
                     "coords": [list(mesh.coords(r).values()) for r in range(mesh.size)]},
            "strings": self.strings.items,
            "types": self.types.items,
            "layouts": self.layouts.items,
            "group_sets": self.groups.items,
            "values": self.values,
            "graphs": self.graphs,
            "ops": self.ops,
            "collectives": self.collectives,
            "plan_ops": [i for i, e in enumerate(self.ops) if "collective" not in e],
            "alternatives": None,
        }


def _plain(x):
    """A collective's param as JSON: tuples become lists, anything else its printed form."""
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    if isinstance(x, (tuple, list)):
        return [_plain(e) for e in x]
    return fmt(x)


def plan_data(graph: Graph) -> dict:
    """The plan of a compiled (localized) graph as JSON-ready data."""
    return _Builder(graph).build()


def to_json(data: dict) -> str:
    """Compact, but one list item per line: a dump's plan.json (and a golden copy of
    it) then diffs line by line."""
    def dump(x):
        return json.dumps(x, separators=(",", ":"))
    parts = []
    for key, value in data.items():
        if isinstance(value, list) and value:
            body = "[\n" + ",\n".join(dump(item) for item in value) + "\n]"
        else:
            body = dump(value)
        parts.append(f"{dump(key)}:{body}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_plan_json(dump_dir: str, graph: Graph) -> None:
    with open(os.path.join(dump_dir, FILE_NAME), "w") as f:
        f.write(to_json(plan_data(graph)))


def load_plan_data(path: str) -> dict:
    """Read ``plan.json`` (a dump folder, or the file itself)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such dump folder")
    if os.path.isdir(path):
        path = os.path.join(path, FILE_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: this dump folder has no plan data (an older shardprop "
                                "wrote it). parallelize(..., dump_dir=DIR) and plan.dump(DIR) write it; "
                                "compile again with a dump_dir")
    with open(path) as f:
        data = json.load(f)
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path} has schema {data.get('schema')!r}; this shardprop reads {SCHEMA!r}")
    return data
