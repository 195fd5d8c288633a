"""Strategies for the fuzzer: drawing valid ones, planting invalid ones, and
judging a whole program (``expect``) independently of how it was drawn, so a
shrunk program is judged afresh.

A mark is *valid* when its split counts (or mesh axes) fit the mesh and the
shapes and agree on dims that are one factor; *invalid* when the compiler must
refuse it; *may_reject* when it splits a dim the operator needs whole (a mark
there may be refused with a clear ShardingError, or honoured by redistributing).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .ops import FAMILIES
from .program import KEY, RAWKEY, Program, infer, mesh_axes

VALID, MAY_REJECT, INVALID = "valid", "may_reject", "invalid"


def _pow2_divisors(n: int, budget: int) -> list:
    return [s for s in (2, 4, 8) if n % s == 0 and budget % s == 0]


# -- drawing ----------------------------------------------------------------------------------------
def draw_key_splits(rng, sizes: dict, mesh, avoid: set, forbid: set, p_whole: float = 0.15) -> dict:
    """key -> split count (device-count mesh) or tuple of axes (named mesh), valid together."""
    keys = list(sizes)
    out = {k: (1 if isinstance(mesh, int) else ()) for k in keys}
    if isinstance(mesh, int):
        budget = mesh
        for k in rng.permutation(len(keys)):
            k = keys[k]
            if k in forbid or (k in avoid and rng.random() > p_whole):
                continue
            opts = _pow2_divisors(sizes[k], budget)
            if opts and rng.random() < 0.6:
                out[k] = int(opts[int(rng.integers(len(opts)))])
                budget //= out[k]
        return out
    axes = mesh_axes(mesh)
    for a in rng.permutation(list(axes)):
        a = str(a)
        if rng.random() > 0.65:
            continue
        ok = [k for k in keys if k not in forbid and (k not in avoid or rng.random() < p_whole)
              and sizes[k] % (math.prod(axes[b] for b in out[k]) * axes[a]) == 0]
        if ok:
            k = ok[int(rng.integers(len(ok)))]
            out[k] = out[k] + (a,)
    return out


def strategy_from_keys(keys_row, assign, mesh, rng=None) -> tuple:
    if isinstance(mesh, int):
        return ("s", tuple(assign[k] for k in keys_row))
    entries = [None if not assign[k] else (assign[k][0] if len(assign[k]) == 1 else assign[k]) for k in keys_row]
    while entries and entries[-1] is None and rng is not None and rng.random() < 0.5:
        entries.pop()            # P('dp') for a rank-2 tensor: trailing dims unsplit
    return ("p", tuple(entries))


def valid_tensor_strategy(rng, shape, mesh) -> tuple:
    keys = [("t", d) for d in range(len(shape))]
    assign = draw_key_splits(rng, dict(zip(keys, shape)), mesh, set(), set())
    return strategy_from_keys(keys, assign, mesh, rng)


def valid_mark(rng, instr, types, mesh):
    ts = [types[a] for a in instr.args]
    cl = FAMILIES[instr.op].classes(ts, instr.params)
    sizes = {}
    for row, t in zip(cl.keys, ts):
        for k, n in zip(row, t.shape):
            sizes[k] = n
    forbid = set(cl.one) | {k for row, t in zip(cl.keys, ts) if t.dtype in (KEY, RAWKEY) for k in row}
    for _ in range(4):      # prefer a mark that splits something
        assign = draw_key_splits(rng, sizes, mesh, set(cl.whole), forbid)
        if any(v not in (1, ()) for v in assign.values()):
            break
    return tuple(strategy_from_keys(row, assign, mesh, rng) for row in cl.keys)


# -- judging ----------------------------------------------------------------------------------------
def tensor_problem(s, shape, mesh) -> Optional[tuple]:
    """(status, why) if one tensor's strategy cannot lay out this shape on this mesh."""
    kind, body = s
    n = mesh if isinstance(mesh, int) else math.prod(mesh[0])
    if kind == "s":
        if len(body) != len(shape):
            return INVALID, f"{len(body)} split counts for rank {len(shape)}"
        for k, d in zip(body, shape):
            if d % k:
                return INVALID, f"split {k} of a dim of size {d}"
        if math.prod(body) > n or n % math.prod(body):
            return INVALID, f"splits {body} need {math.prod(body)} of {n} devices"
        return None
    axes = mesh_axes(mesh)
    if len(body) > len(shape):
        return INVALID, f"{len(body)} PartitionSpec entries for rank {len(shape)}"
    seen = []
    for e, d in zip(body, shape):
        names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        for a in names:
            if a not in axes:
                return INVALID, f"unknown mesh axis {a!r}"
            if a in seen:
                return INVALID, f"mesh axis {a!r} used twice"
            seen.append(a)
        if d % math.prod(axes[a] for a in names):
            return INVALID, f"axes {names} do not divide size {d}"
    return None


def _entry_axes(s, d):
    kind, body = s
    if kind == "s":
        return body[d]
    if d >= len(body) or body[d] is None:
        return ()
    return (body[d],) if isinstance(body[d], str) else tuple(body[d])


def _axis_sizes(s, d, mesh) -> list:
    """The sizes of the mesh axes splitting dim d, major first (a split count on a device-count
    mesh is a run of its prime axes)."""
    v = _entry_axes(s, d)
    if isinstance(v, int):
        out, k = [], v
        for q in (2, 3, 5, 7):
            while k % q == 0:
                out.append(q)
                k //= q
        return out
    axes = mesh_axes(mesh)
    return [axes.get(a, 1) for a in v]


def mark_problem(instr, types, mesh) -> Optional[tuple]:
    ts = [types[a] for a in instr.args]
    fam = FAMILIES[instr.op]
    cl = fam.classes(ts, instr.params)
    m = instr.mark
    worst = None
    for s, shape in [(s, shape) for s, shape in (fam.inner(instr.params, ts) if fam.inner else [])]:
        p = tensor_problem(s, shape, mesh)
        if p:
            return p
    if len(m.ins) != len(ts):
        return INVALID, f"{len(m.ins)} entries for {len(ts)} arguments"
    named = not isinstance(mesh, int)
    for s, t in zip(m.ins, ts):
        if s[0] == "p" and not named:
            return INVALID, "PartitionSpec on a device-count mesh"
        if s[0] == "s" and len(s[1]) != t.rank:
            return INVALID, f"{len(s[1])} split counts for rank {t.rank}"
        if s[0] == "s" and named:
            n = math.prod(mesh[0])
            if math.prod(s[1]) > n:
                return INVALID, f"splits need {math.prod(s[1])} of {n} devices"
            worst = worst or (MAY_REJECT, "split counts on a named mesh")
        p = tensor_problem(s, t.shape, mesh) if s[0] == "p" else None
        if p:
            return p
        for d, n in enumerate(t.shape):
            if s[0] == "s" and n % s[1][d]:
                return INVALID, f"split {s[1][d]} of a dim of size {n}"
    seen: dict = {}
    for s, row in zip(m.ins, cl.keys):
        for d, k in enumerate(row):
            v = _entry_axes(s, d)
            if seen.setdefault(k, v) != v:
                return INVALID, f"one factor split {seen[k]} and {v}"
    if not named:
        total = math.prod(v for v in seen.values())
        if total > mesh or mesh % total:
            return INVALID, f"device matrix needs {total} of {mesh} devices"
    else:
        used = [a for v in seen.values() for a in v]
        if len(used) != len(set(used)):
            worst = worst or (MAY_REJECT, "one mesh axis on two factors")
    for k, v in seen.items():
        if v not in (1, ()) and k in cl.one:
            worst = worst or (MAY_REJECT, "a PRNG key split")
        elif v not in (1, ()) and k in cl.whole:
            worst = worst or (MAY_REJECT, "splits a dim the operator needs whole")
    if fam.mark_check is not None and ts and len(m.ins[0][1]) <= ts[0].rank:
        why = fam.mark_check(ts, instr.params, [_axis_sizes(m.ins[0], d, mesh) for d in range(ts[0].rank)])
        if why:
            worst = worst or (MAY_REJECT, why)
    if m.outs is not None:
        outs = [types[o] for o in instr.outs]
        if len(m.outs) != len(outs):
            return INVALID, f"{len(m.outs)} out entries for {len(outs)} results"
        for s, t in zip(m.outs, outs):
            if s[0] == "p" and not named:
                return INVALID, "PartitionSpec on a device-count mesh"
            p = tensor_problem(s, t.shape, mesh)
            if p:
                return p
    return worst


@dataclass
class Expectation:
    status: str                     # valid | may_reject | invalid
    why: str = ""
    lines: tuple = ()               # instr indices whose marks are not plainly valid
    at_parallelize: bool = False    # the verdict comes from parallelize's own in/out strategies or mode


def expect(program: Program, types=None) -> Expectation:
    types = types or infer(program)
    mesh, named = program.mesh, program.named
    problems = {}
    for i, ins in enumerate(program.instrs):
        if ins.mark is not None:
            p = mark_problem(ins, types, mesh)
            if p:
                problems[i] = p
    lines = tuple(problems)
    for i, (status, why) in problems.items():
        if status == INVALID:
            return Expectation(INVALID, f"{program.instrs[i].op}: {why}", lines)
    found = Expectation(VALID)
    if problems:
        i, (status, why) = next(iter(problems.items()))
        found = Expectation(MAY_REJECT, f"{program.instrs[i].op}: {why}", lines)
    if program.bad_in_structure:
        return Expectation(INVALID, "parallelize in_strategy has an entry too many", lines, True)
    if program.bad_out_structure:
        return Expectation(INVALID, "parallelize out_strategy does not match the outputs", lines, True)
    for name, s in program.in_strategy.items():
        if s[0] == "p" and not named:
            return Expectation(INVALID, f"in_strategy for {name}: PartitionSpec on a device-count mesh", lines, True)
        p = tensor_problem(s, types[name].shape, mesh)
        if p:
            return Expectation(p[0], f"in_strategy for {name}: {p[1]}", lines, True)
    for o, s in zip(program.outputs, program.out_strategy or ()):
        if s is None:
            continue
        if s[0] == "p" and not named:
            return Expectation(INVALID, f"out_strategy for {o}: PartitionSpec on a device-count mesh", lines, True)
        p = tensor_problem(s, types[o].shape, mesh)
        if p:
            return Expectation(p[0], f"out_strategy for {o}: {p[1]}", lines, True)
    if program.mode == "data_parallel":
        batch = program.args_order()[-1] if program.args_order() else None
        t = types.get(batch)
        if t is None or t.dtype in (KEY, RAWKEY) or not t.shape or t.shape[0] % program.n_devices:
            return Expectation(INVALID, f"data_parallel batch {batch} of shape {t.shape if t else None}", lines, True)
    return found


# -- planting ---------------------------------------------------------------------------------------
INVALID_KINDS = ("devices", "axis_unknown", "axis_twice", "not_divisible", "size1", "entries", "mismatch",
                 "out_entries")


def invalid_tensor(rng, kind, shape, mesh) -> Optional[tuple]:
    """One tensor's strategy that is invalid in the given way, or None if this shape cannot show it."""
    r = len(shape)
    named = not isinstance(mesh, int)
    n = mesh if not named else math.prod(mesh[0])
    if kind == "devices":
        splits = [max([1] + [s for s in (2, 4, 8, 16) if d % s == 0]) for d in shape]
        if math.prod(splits) <= n:
            return None
        return ("s", tuple(splits))
    if kind == "axis_unknown":
        if r == 0:
            return None
        d = int(rng.integers(r))
        return ("p", tuple("zz" if i == d else None for i in range(r))) if named else \
            ("p", tuple("dp" if i == d else None for i in range(r)))
    if kind == "axis_twice":
        axes = mesh_axes(mesh)
        if not named:
            return None
        for a, size in axes.items():
            dims = [d for d in range(r) if shape[d] % size == 0]
            if len(dims) >= 2:
                return ("p", tuple(a if i in dims[:2] else None for i in range(r)))
            if dims and shape[dims[0]] % (size * size) == 0:
                return ("p", tuple((a, a) if i == dims[0] else None for i in range(r)))
        return None
    if kind in ("not_divisible", "size1"):
        if named:
            axes = mesh_axes(mesh)
            for d in rng.permutation(r):
                for a, size in axes.items():
                    if shape[d] % size and (kind == "not_divisible" or shape[d] == 1):
                        return ("p", tuple(a if i == d else None for i in range(r)))
            return None
        for d in rng.permutation(r):
            if shape[d] % 2 and (kind == "not_divisible" or shape[d] == 1):
                return ("s", tuple(2 if i == d else 1 for i in range(r)))
        return None
    if kind == "entries":
        if named and rng.random() < 0.5:
            return ("p", (None,) * (r + 1))
        return ("s", (1,) * (r + 1 if r == 0 or rng.random() < 0.5 else r - 1))
    return None
