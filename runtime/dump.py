"""IR dump files: one global file per pass, one program per rank, a summary, and
the plan as data (``plan.json``, what ``shardprop report DIR`` draws).

At scale (more than ``RANK_FILES_UP_TO`` ranks) the per-rank programs are written
as *rank classes*: ranks whose programs are equal up to their group ids and offsets
share one template, ``rank_classes/class_<c>.ir``, in which each rank-dependent
field is a hole (``${rank}``, ``${coords}``, ``${group:dp,mp}``: the ranks of the
rank's group over those axes, ``${index:mp*64}``: its index along the axes times a
block size, ``${recv:k}``/``${send:k}``: the k-th permute's partner, from the
permute table), and ``rank_classes/index.txt`` says which ranks each class holds.
``expand_rank(dump_dir, r)`` (or ``rank_text``) gives back exactly the text
``print_graph(graph, rank=r)`` prints; ``dump_ranks`` also writes chosen ranks'
``rank_<r>/execute.ir`` files. Holes are patterns over the mesh, computed per rank
only when asked: a dump's size and time do not grow with the mesh.
"""
from __future__ import annotations

import json
import os
import re
from collections import defaultdict

from ..ir.graph import COLLECTIVE_KINDS, Graph, is_collective
from ..ir.mesh import Mesh
from ..ir.printer import _collective_params, _user_collective_params, fmt_params, op_comment, print_graph
from .plan_data import write_plan_json

RANK_FILES_UP_TO = 64   # meshes up to this many ranks get one execute.ir per rank (as always); larger, classes


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


def write_dumps(dump_dir: str, graph: Graph, pass_texts: dict, ranks=None, write_global: bool = True,
                dump_ranks=None) -> None:
    """Write ``NN_<pass>.ir``, ``rank_<r>/execute.ir`` for each rank, ``summary.txt`` and ``plan.json``.
    ``ranks`` limits the per-rank files to the ranks this process owns; ``write_global``
    says whether this process writes the files common to all ranks. On a mesh of more
    than ``RANK_FILES_UP_TO`` ranks the programs are written as rank classes (module
    doc) and ``rank_<r>/execute.ir`` only for the ranks in ``dump_ranks``; on a smaller
    one ``dump_ranks`` (if given) picks the ranks written."""
    os.makedirs(dump_dir, exist_ok=True)
    for name, text in (pass_texts.items() if write_global else ()):
        with open(os.path.join(dump_dir, name), "w") as f:
            f.write(text)
    mesh = graph.mesh
    mine = range(mesh.size) if ranks is None else ranks
    classes = None
    if mesh.size > RANK_FILES_UP_TO and write_global:
        classes = rank_classes(graph)
        write_rank_classes(dump_dir, classes)
    if dump_ranks is not None:
        picked = set(int(r) for r in dump_ranks)
        bad = sorted(r for r in picked if not 0 <= r < mesh.size)
        if bad:
            raise ValueError(f"dump_ranks {bad} are not ranks of a mesh of {mesh.size}")
        mine = [r for r in mine if r in picked]
    elif mesh.size > RANK_FILES_UP_TO:
        mine = []
    for r in mine:
        d = os.path.join(dump_dir, f"rank_{r}")
        os.makedirs(d, exist_ok=True)
        text = expand(classes, r) if classes is not None else print_graph(
            graph, rank=r, title=f"program executed by rank {r}")
        with open(os.path.join(d, "execute.ir"), "w") as f:
            f.write(text)
    if write_global:
        with open(os.path.join(dump_dir, "summary.txt"), "w") as f:
            f.write(summary_text(graph))
        write_plan_json(dump_dir, graph)


# -- rank classes --------------------------------------------------------------------
_HOLE = re.compile(r"\$\{(\w+)(?::([^}]*))?\}")


class _Hole(str):
    """A field printed as ``${kind:args}``: fmt prints a str as it is."""

    def __new__(cls, kind: str, args: str = ""):
        return str.__new__(cls, "${" + kind + (":" + args if args else "") + "}")


def _index_hole(axes, block: int):
    axes = tuple(axes)
    return 0 if not axes else _Hole("index", ",".join(axes) + f"*{block}")


def _tuple_text(elements) -> str:
    """str() of a tuple whose elements may be holes (printed bare, like ints)."""
    inner = ", ".join(str(e) for e in elements)
    return f"({inner},)" if len(elements) == 1 else f"({inner})"


def _template_params(op, mesh, program_mesh, permutes: list):
    if is_collective(op):
        p = dict(op.params)
        p.pop("wire_bytes", None)
        if op.kind == "slice":
            shape_in, shape_out = op.inputs[0].local_type.shape, op.outputs[0].local_type.shape
            begin = [0] * len(shape_in)
            end = list(shape_out)
            for d, axes in p["cuts"]:
                begin[d] = _index_hole(axes, shape_out[d])
                end[d] = _Hole("index", ",".join(axes) + f"*{shape_out[d]}+{shape_out[d]}") if axes else shape_out[d]
            return {"begin": tuple(begin), "end": tuple(end)}
        if op.kind == "permute":
            permutes.append([list(pair) for pair in p["pairs"]])
            k = len(permutes) - 1
            return {"recv_from": _Hole("recv", str(k)), "send_to": _Hole("send", str(k))}
        axes = p.pop("axes")
        return {"group_ranks": _Hole("group", ",".join(axes)), **p}
    params = op.local_params
    if program_mesh is not None:
        for key in ("axes", "axis_name"):
            axes = (params or {}).get(key)
            axes = (axes,) if isinstance(axes, str) else axes
            if isinstance(axes, tuple) and axes and all(isinstance(a, str) and a in program_mesh.axis_names
                                                        for a in axes):
                return {**params, "group_ranks": _Hole("group", ",".join(axes))}
    return params


def _template_ops(graph: Graph, lines: list, i: int, permutes: list, program_mesh=None) -> int:
    """Put holes into the op lines of ``lines`` (rank 0's text) from line ``i`` on, walking
    the ops as ``ir.printer._print_ops`` prints them; returns the line after them."""
    mesh = graph.mesh
    for op in graph.ops:
        if is_collective(op) or program_mesh is not None:
            params0 = _collective_params(op, 0, mesh) if is_collective(op) else op.local_params
            if program_mesh is not None:
                params0 = _user_collective_params(params0, 0, program_mesh)
            skip = ("wire_bytes", "body")
            p0 = fmt_params(params0 or {}, skip=skip)
            pt = fmt_params(_template_params(op, mesh, program_mesh, permutes) or {}, skip=skip)
            if p0 != pt:
                sig = (f"({', '.join(str(v.local_type) for v in op.inputs)}) -> "
                       f"{', '.join(str(v.local_type) for v in op.outputs)}")
                tail = f"{p0} : {sig}"
                if not lines[i].endswith(tail):
                    raise _NoTemplate(f"op line {i}")
                lines[i] = lines[i][:-len(tail)] + f"{pt} : {sig}"
        i += 1
        if op_comment(op, mesh, False):
            i += 1
        for body in op.subgraphs:
            i = _template_ops(body, lines, i + 1 + len(body.inputs), permutes, program_mesh) + 2
        per_device = op.params.get("body")
        if isinstance(per_device, Graph):
            i = _template_ops(per_device, lines, i + 1 + len(per_device.inputs), permutes, mesh) + 2
    return i


class _NoTemplate(Exception):
    pass


def rank_classes(graph: Graph, check=None) -> dict:
    """The per-rank programs as classes: {"mesh", "templates", "index" (one class per
    rank), "permutes"}. One template serves every rank whose program differs only in
    holes; it is checked against ``print_graph`` on the ``check`` ranks (default: the
    first, the last and a few between). A rank whose text the template does not give
    back gets a class of its own, its full text."""
    mesh = graph.mesh
    text0 = print_graph(graph, rank=0, title="program executed by rank 0")
    lines = text0.split("\n")
    permutes: list = []
    try:
        if "${" in text0:
            raise _NoTemplate("the program text holds '${'")
        lines[0] = "# shardprop program executed by rank ${rank}"
        lines[1] = f"# rank ${{rank}} of {mesh.size}; mesh {mesh}; coords ${{coords}}"
        for i, v in enumerate(graph.inputs):
            off = str(v.layout.offsets(0, v.type.shape, mesh))
            if not lines[3 + i].endswith(f"offsets={off}"):
                raise _NoTemplate(f"input {i}")
            holes = [_index_hole(d, n) for d, n in zip(v.layout.dims, v.layout.local_shape(v.type.shape, mesh))]
            lines[3 + i] = lines[3 + i][:-len(off)] + _tuple_text(holes)
        _template_ops(graph, lines, 4 + len(graph.inputs), permutes)
        templates = ["\n".join(lines)]
    except _NoTemplate:
        templates = []
    out = {"mesh": {"axes": list(mesh.axis_names), "sizes": list(mesh.axis_sizes)}, "templates": templates,
           "index": [0] * mesh.size, "permutes": permutes}
    if not templates:   # one class per rank: the text as printed
        out["templates"] = [print_graph(graph, rank=r, title=f"program executed by rank {r}")
                            for r in range(mesh.size)]
        out["index"] = list(range(mesh.size))
        return out
    n = mesh.size
    for r in sorted(set(check if check is not None else (0, 1, n // 3, n // 2, n - 2, n - 1))):
        if 0 <= r < n:
            want = print_graph(graph, rank=r, title=f"program executed by rank {r}")
            if expand(out, r) != want:
                out["index"][r] = len(out["templates"])
                out["templates"].append(want)
    return out


def expand(classes: dict, rank: int) -> str:
    """Rank ``rank``'s program text from its class's template (module doc)."""
    mesh = Mesh(tuple(classes["mesh"]["axes"]), tuple(classes["mesh"]["sizes"]))
    template = classes["templates"][classes["index"][rank]]
    coords = mesh.coords(rank)

    def fill(m):
        kind, args = m.group(1), m.group(2) or ""
        if kind == "rank":
            return str(rank)
        if kind == "coords":
            return " ".join(f"{a}={c}" for a, c in coords.items())
        if kind == "group":
            return "-".join(map(str, mesh.group(rank, tuple(args.split(",")))))
        if kind == "index":
            axes, _, rest = args.partition("*")
            block, _, extra = rest.partition("+")
            return str(mesh.linear_index(rank, tuple(axes.split(","))) * int(block) + int(extra or 0))
        pairs = classes["permutes"][int(args)]
        if kind == "recv":
            return str(next(s for s, d in pairs if d == rank))
        return str(next(d for s, d in pairs if s == rank))
    return _HOLE.sub(fill, template)


def write_rank_classes(dump_dir: str, classes: dict) -> None:
    """``rank_classes/class_<c>.ir``, ``index.txt`` (class: its ranks, as ranges) and
    ``classes.json`` (what ``expand_rank`` reads: mesh, index, permute tables)."""
    d = os.path.join(dump_dir, "rank_classes")
    os.makedirs(d, exist_ok=True)
    members: dict = defaultdict(list)
    for r, c in enumerate(classes["index"]):
        members[c].append(r)
    for c, text in enumerate(classes["templates"]):
        with open(os.path.join(d, f"class_{c}.ir"), "w") as f:
            f.write(text)
    lines = [f"# rank classes of mesh {dict(zip(classes['mesh']['axes'], classes['mesh']['sizes']))}: ranks whose "
             "programs differ only in group ids and offsets share a template (class_<c>.ir)",
             "# holes: ${rank} ${coords} ${group:AXES} (its group's ranks) ${index:AXES*B[+E]} (index along AXES "
             "times B, plus E) ${recv:K} ${send:K} (permute K's partner, classes.json)",
             "# expand one: python -c \"from shardprop.runtime.dump import expand_rank; "
             "print(expand_rank('DIR', RANK))\""]
    for c in sorted(members):
        lines.append(f"class {c}: ranks {_ranges(members[c])}")
    with open(os.path.join(d, "index.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(d, "classes.json"), "w") as f:
        json.dump({k: v for k, v in classes.items() if k != "templates"}, f, separators=(",", ":"))


def expand_rank(dump_dir: str, rank: int) -> str:
    """The program rank ``rank`` executes, from a dump's rank classes."""
    d = os.path.join(dump_dir, "rank_classes")
    with open(os.path.join(d, "classes.json")) as f:
        classes = json.load(f)
    if not 0 <= rank < len(classes["index"]):
        raise ValueError(f"rank {rank} is not a rank of this dump's mesh of {len(classes['index'])}")
    c = classes["index"][rank]
    with open(os.path.join(d, f"class_{c}.ir")) as f:
        text = f.read()
    classes["templates"] = {c: text}
    return expand(classes, rank)


def _ranges(ranks: list) -> str:
    out, start = [], None
    for k, r in enumerate(ranks):
        if start is None:
            start = r
        if k + 1 == len(ranks) or ranks[k + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)
