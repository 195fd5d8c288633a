"""Text form of a Graph: one global view, or the program one rank executes.

Deterministic by construction: values are named at print time (inputs by their
argument names, others by position), params are printed with sorted keys and
without object addresses, and nothing depends on time or memory. So two ranks'
files differ exactly where their programs differ (collective groups, slice
offsets), and golden files can be checked in.
"""
from __future__ import annotations

import enum
import re
from typing import Optional

import numpy as np

from .graph import Graph, Op, Value, is_collective
from .layout import Layout

_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")


def fmt(x) -> str:
    if x is None or isinstance(x, (bool, int, str)):
        return str(x)
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, Layout):
        return str(x)
    if isinstance(x, np.dtype):
        return x.name
    if isinstance(x, np.generic):
        return fmt(x.item())
    if isinstance(x, np.ndarray):
        return f"array{tuple(x.shape)}"
    if isinstance(x, enum.Enum):
        return x.name
    if isinstance(x, type):
        return x.__name__
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x).__name__ + "(" + ", ".join(f"{k}={fmt(getattr(x, k))}" for k in x._fields) + ")"
    if isinstance(x, (tuple, list)):
        inner = ", ".join(fmt(e) for e in x)
        return f"({inner},)" if isinstance(x, tuple) and len(x) == 1 else (f"({inner})" if isinstance(x, tuple) else f"[{inner}]")
    if isinstance(x, (set, frozenset)):
        return "{" + ", ".join(sorted(fmt(e) for e in x)) + "}"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{fmt(k)}: {fmt(v)}" for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))) + "}"
    if type(x).__name__ in ("ClosedJaxpr", "Jaxpr"):
        return "<jaxpr>"
    if isinstance(x, Graph):
        return "<body>"   # a per-device body (a user's shard_map) is printed as code of its own
    if hasattr(x, "name") and isinstance(getattr(x, "name"), str) and type(x).__name__.endswith("DType"):
        return x.name
    if callable(x) and hasattr(x, "__name__"):
        return x.__name__
    return _ADDR.sub("", repr(x))


def fmt_params(params: dict, skip=()) -> str:
    items = [(k, v) for k, v in sorted(params.items()) if k not in skip and v is not None]
    return "{" + ", ".join(f"{k}={fmt(v)}" for k, v in items) + "}" if items else ""


def _sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "_", name).strip("_") or "arg"


class Namer:
    def __init__(self, graph: Graph):
        self.names: dict[int, str] = {}
        taken = set()
        for i, v in enumerate(graph.inputs):
            base = _sanitize(graph.input_names[i]) if i < len(graph.input_names) else f"arg{i}"
            name, k = base, 1
            while name in taken:
                name, k = f"{base}_{k}", k + 1
            taken.add(name)
            self.names[v.id] = name
        self.next = 0

    def define(self, v: Value) -> str:
        if v.id not in self.names:
            self.names[v.id] = str(self.next)
            self.next += 1
        return "%" + self.names[v.id]

    def use(self, v: Value) -> str:
        if v.is_literal:
            return f"{fmt(np.asarray(v.literal).item())}:{str(v.type).split('[')[0]}"
        return "%" + self.names.get(v.id, f"?{v.id}")


def _splits(layouts, mesh) -> str:
    return fmt(tuple(l.splits(mesh) for l in layouts))


def op_comment(op: Op, mesh, global_view: bool) -> str:
    parts = []
    if op.strategy is not None and not is_collective(op):
        ins = [op.strategy.operand_layout(n, v.type.rank, mesh) for n, v in enumerate(op.inputs)]
        outs = [op.strategy.result_layout(n, mesh) for n in range(len(op.outputs))]
        parts.append(f"strategy={_splits(ins, mesh)} -> {_splits(outs, mesh)}")
    if op.origin:
        parts.append(f"origin={op.origin}")
    if op.note:
        parts.append(op.note)
    if op.source:
        parts.append(f"source={op.source}")
    return "    # " + " ".join(parts) if parts else ""


def _collective_params(op: Op, rank: int, mesh) -> dict:
    p = dict(op.params)
    p.pop("wire_bytes", None)
    out = {}
    if op.kind == "slice":
        shape_in = op.inputs[0].local_type.shape
        shape_out = op.outputs[0].local_type.shape
        begin = [0] * len(shape_in)
        for d, axes in p["cuts"]:
            begin[d] = mesh.linear_index(rank, axes) * shape_out[d]
        out["begin"] = tuple(begin)
        out["end"] = tuple(b + s for b, s in zip(begin, shape_out))
        return out
    if op.kind == "permute":
        pairs = p["pairs"]
        out["recv_from"] = next(s for s, d in pairs if d == rank)
        out["send_to"] = next(d for s, d in pairs if s == rank)
        return out
    axes = p.pop("axes")
    out["group_ranks"] = "-".join(map(str, mesh.group(rank, axes)))
    out.update(p)
    return out


def print_graph(graph: Graph, rank: Optional[int] = None, title: str = "") -> str:
    """The global program (``rank=None``) or the program rank ``rank`` executes."""
    mesh = graph.mesh
    local = rank is not None
    namer = Namer(graph)
    lines = []
    head = f"# shardprop {title}".rstrip()
    lines.append(head)
    if local:
        coords = " ".join(f"{a}={c}" for a, c in mesh.coords(rank).items())
        lines.append(f"# rank {rank} of {mesh.size}; mesh {mesh}; coords {coords}")
    else:
        lines.append(f"# global program; mesh {mesh} ({mesh.size} devices)")
    lines.append("")
    for i, v in enumerate(graph.inputs):
        name = namer.define(v)
        kind = "const" if v.const is not None else "input"
        if local:
            lines.append(f"{name} = {kind}[{i}] : {v.local_type}    # global {v.type} layout={v.layout} "
                         f"offsets={v.layout.offsets(rank, v.type.shape, mesh)}")
        else:
            lay = f" {v.layout}" if v.layout is not None else ""
            lines.append(f"{name} = {kind}[{i}] : {v.type}{lay}")
    lines.append("")
    # shard() calls are numbered globally at trace time; print them by order within this graph
    region_no = {rid: i for i, rid in enumerate(sorted(graph.regions), start=1)}
    _print_ops(graph, rank, namer, region_no, lines, "")
    lines.append("")
    lines.append("return " + ", ".join(namer.use(v) for v in graph.outputs))
    return "\n".join(lines) + "\n"


def _typed(v: Value) -> str:
    return f"{v.type} {v.layout}" if v.layout is not None and not v.is_literal else str(v.type)


def _print_ops(graph: Graph, rank, namer: Namer, region_no: dict, lines: list, indent: str,
               program_mesh=None) -> None:
    """``program_mesh``: set inside a per-device body, whose own collectives then show their groups."""
    mesh = graph.mesh
    local = rank is not None
    for op in graph.ops:
        ins = ", ".join(namer.use(v) for v in op.inputs)
        outs = ", ".join(namer.define(v) for v in op.outputs)
        if local:
            params = _collective_params(op, rank, mesh) if is_collective(op) else op.local_params
            if program_mesh is not None:
                params = _user_collective_params(params, rank, program_mesh)
            sig = (f"({', '.join(str(v.local_type) for v in op.inputs)}) -> "
                   f"{', '.join(str(v.local_type) for v in op.outputs)}")
        else:
            params = op.params
            sig = f"({', '.join(_typed(v) for v in op.inputs)}) -> {', '.join(_typed(v) for v in op.outputs)}"
            if op.pinned is not None:
                params = {**params, "pinned": op.pinned}
            if "region" in params:
                params = {**params, "region": region_no.get(params["region"], params["region"])}
        p = fmt_params(params or {}, skip=("wire_bytes", "body") if local else ("body",))
        lines.append(indent + f"{outs} = {op.kind}({ins}) {p} : {sig}".replace(")  :", ") :"))
        c = op_comment(op, mesh, not local)
        if c:
            lines.append(indent + c)
        for i, body in enumerate(op.subgraphs):
            lines.append(indent + f"  body {i} {{")
            for k, v in enumerate(body.inputs):
                t = (f"{v.local_type}" if local else _typed(v))
                lines.append(indent + f"    {namer.define(v)} = body_input[{k}] : {t}")
            _print_ops(body, rank, namer, region_no, lines, indent + "    ", program_mesh)
            lines.append(indent + "    yield " + ", ".join(namer.use(v) for v in body.outputs))
            lines.append(indent + "  }")
        per_device = op.params.get("body")
        if isinstance(per_device, Graph):
            # a user's shard_map: per-device code, the same on every rank, run as written
            lines.append(indent + "  per-device body {")
            for k, v in enumerate(per_device.inputs):
                t = v.local_type if local and v.local_type is not None else v.type
                lines.append(indent + f"    {namer.define(v)} = body_input[{k}] : {t}")
            _print_ops(per_device, rank, namer, region_no, lines, indent + "    ", mesh)
            lines.append(indent + "    yield " + ", ".join(namer.use(v) for v in per_device.outputs))
            lines.append(indent + "  }")


def _user_collective_params(params: Optional[dict], rank: int, mesh) -> Optional[dict]:
    """A collective the user wrote (``psum(x, "mp")``): the ranks it runs over on this rank."""
    for key in ("axes", "axis_name"):
        axes = (params or {}).get(key)
        axes = (axes,) if isinstance(axes, str) else axes
        if isinstance(axes, tuple) and axes and all(isinstance(a, str) and a in mesh.axis_names for a in axes):
            return {**params, "group_ranks": "-".join(map(str, mesh.group(rank, axes)))}
    return params
