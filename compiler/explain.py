"""``plan.explain(...)``: the report's panel for an op, a source line or a
collective, as text. Read from the plan data (runtime/plan_data.py), the same data
the HTML page draws its panel from."""
from __future__ import annotations

import bisect
import os
from typing import Optional

from ..ir.graph import TensorType

ALTERNATIVES_NOTE = "not recorded: propagation keeps only the candidate it chose, not the ones it rejected"


def origin_steps(data: dict, i: int) -> list[str]:
    """The origin of op ``i``, then the origin of the op it names, and so on back to
    a user's mark (or a default, or an op met before). The page follows the same steps."""
    ops, strings = data["ops"], data["strings"]
    steps, seen, cur = [], {i}, i
    while True:
        op = ops[cur]
        steps.append(strings[op["origin"]])
        steps += [strings[s] for s in op.get("via", ())]
        nxt = op["from"]
        if nxt is None:
            return steps
        if nxt in seen:
            steps.append("(names this op itself)" if nxt == cur else f"(op #{nxt} again)")
            return steps
        seen.add(nxt)
        cur = nxt


def chain_line(steps: list[str]) -> str:
    """One line, as the page's origin line reads: "forward from max at net.py:7,
    forward from shard(matmul) at net.py:6 (the user's mark)"."""
    if steps and steps[-1] == "user":
        return ", ".join(steps[:-1]) + " (the user's mark)" if len(steps) > 1 else "the user's mark"
    return ", ".join(steps)


def _tuple(items: list) -> str:
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _splits(data: dict, layout: Optional[int]) -> str:
    if layout is None:
        return "literal"
    sizes = dict(zip(data["mesh"]["axes"], data["mesh"]["sizes"]))
    out = []
    for axes in data["layouts"][layout]["dims"]:
        n = 1
        for a in axes:
            n *= sizes[a]
        out.append(str(n))
    return _tuple(out)


def strategy_text(data: dict, op: dict) -> str:
    """As ``plan.ops`` prints it: split counts per dim, a tuple per operand and per result."""
    return (_tuple([_splits(data, l) for l in op["in_layouts"]]) + " -> "
            + _tuple([_splits(data, l) for l in op["out_layouts"]]))


def type_text(data: dict, t: Optional[int]) -> str:
    if t is None:
        return "?"
    ty = data["types"][t]
    return str(TensorType(tuple(ty["shape"]), ty["dtype"]))   # as the .ir dumps write it


def layout_text(data: dict, layout: Optional[int]) -> str:
    if layout is None:
        return ""
    lay = data["layouts"][layout]
    body = "[" + ", ".join("{" + ",".join(d) + "}" for d in lay["dims"]) + "]"
    if lay["partial"]:
        body += f" partial_{lay['partial_op']}{{{','.join(lay['partial'])}}}"
    return body


def _value_line(data: dict, v: int) -> str:
    val = data["values"][v]
    if "literal" in val:
        return f"{val['name']} (literal)"
    return (f"{val['name']} {type_text(data, val['type'])} {layout_text(data, val['layout'])}"
            f"  per device {type_text(data, val['local'])}")


def _groups_text(data: dict, c: dict) -> str:
    return " ".join("-".join(map(str, g)) for g in data["group_sets"][c["groups"]])


def collective_line(data: dict, ci: int) -> str:
    c = data["collectives"][ci]
    over = f" over {','.join(c['axes'])}" if c["kind"] != "permute" else ""
    return (f"{c['kind']}{over} {tuple(c['in_shape'])} -> {tuple(c['out_shape'])} per device, "
            f"{c['bytes']} bytes, groups {_groups_text(data, c)}")


def op_text(data: dict, i: int, maps: Optional[tuple] = None) -> str:
    ops, strings = data["ops"], data["strings"]
    op = ops[i]
    if "collective" in op:
        return collective_text(data, op["collective"])
    where = f" at {strings[op['source']]}" if op["source"] is not None else ""
    at = bisect.bisect_left(data["plan_ops"], i)   # plan_ops is in program order
    lines = [f"op #{i} (plan.ops[{at}]): {op['kind']}{where}"]
    lines.append(f"  strategy:     {strategy_text(data, op)}")
    steps = origin_steps(data, i)
    lines.append(f"  origin:       {chain_line(steps)}")
    lines.append(f"  alternatives: {ALTERNATIVES_NOTE}")
    if op.get("params") is not None:
        lines.append(f"  params:       {strings[op['params']]}")
    lines.append("  operands:")
    lines += [f"    {_value_line(data, v)}" for v in op["in"]]
    lines.append("  results:")
    lines += [f"    {_value_line(data, v)}" for v in op["out"]]
    around = _collectives_around(data, i, maps or redistribution_maps(data))
    if around:
        lines.append("  redistributions:")
        lines += [f"    {side} {collective_line(data, ci)}" for side, ci in around]
    return "\n".join(lines)


def redistribution_maps(data: dict) -> tuple:
    """({value: the collective that makes it}, {value: the collectives that read it})."""
    made_by, read_by = {}, {}
    for o in data["ops"]:
        if "collective" in o:
            made_by[o["out"][0]] = o["collective"]
            read_by.setdefault(o["in"][0], []).append(o["collective"])
    return made_by, read_by


def _collectives_around(data: dict, i: int, maps: tuple) -> list:
    """Collectives that make this op's operands, and those that take its results."""
    made_by, read_by = maps
    op = data["ops"][i]
    out = [("before:", made_by[v]) for v in op["in"] if v in made_by]
    out += [("after: ", ci) for v in op["out"] for ci in read_by.get(v, ())]
    return out


def collective_text(data: dict, ci: int) -> str:
    c = data["collectives"][ci]
    lines = [f"collective #{ci} (op #{c['op']}): {c['kind']}" + (f" at {c['source']}" if c["source"] else "")]
    lines.append(f"  {collective_line(data, ci)}")
    lines.append(f"  dtype {c['dtype']}, params {c['params']}")
    if c["reason"]:
        lines.append(f"  inserted {c['reason']}")
    op = data["ops"][c["op"]]
    lines.append(f"  from {_value_line(data, op['in'][0])}")
    lines.append(f"  to   {_value_line(data, op['out'][0])}")
    return "\n".join(lines)


def ops_at(data: dict, line: str) -> list[int]:
    """Ops whose source is ``file.py:LINE`` (a path is reduced to its file name, as
    sources are recorded)."""
    want = os.path.basename(line.strip())
    strings = data["strings"]
    return [i for i, op in enumerate(data["ops"]) if op["source"] is not None and strings[op["source"]] == want]


def source_text(data: dict, line: str) -> str:
    found = ops_at(data, line)
    if not found:
        known = sorted({data["strings"][op["source"]] for op in data["ops"] if op["source"] is not None})
        raise ValueError(f"no operator comes from {line!r}; source lines in this plan: {', '.join(known)}")
    n_coll = sum(1 for i in found if "collective" in data["ops"][i])
    head = f"{os.path.basename(line.strip())}: {len(found) - n_coll} operators, {n_coll} collectives"
    maps = redistribution_maps(data)
    return "\n\n".join([head] + [op_text(data, i, maps) for i in found])


def search_text(result) -> str:
    """A mode="auto" plan's decisions (``plan.explain()``)."""
    if result is None:
        return ("plan.explain() without an argument explains a mode='auto' search; this plan was propagated: "
                "pass an op, a source line or a collective")
    return "\n".join([str(result), "decisions (matmul / conv):"] + [str(d) for d in result.decisions])
