"""Greedy shrinking: the smallest program that still fails the same way.

Each step proposes a simpler program (a wrapper or the mode dropped, a strategy or
mark removed, an instruction removed with its uses rewired, a smaller mesh, a
smaller dim) and keeps it if it is still well formed, is judged the same by
``strategies.expect`` (a valid program stays valid), and ``fails`` says yes.
Steps repeat until none applies or the budget runs out.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

from .program import Inconsistent, Program, TType
from .render import check
from .strategies import expect


def _fresh_input(p: Program, t: TType) -> str:
    k = len(p.inputs)
    while f"x{k}" in p.inputs:
        k += 1
    name = f"x{k}"
    p.inputs[name] = t
    return name


def _replace_uses(p: Program, old: str, new: str, after: int) -> None:
    for ins in p.instrs[after:]:
        ins.args = tuple(new if a == old else a for a in ins.args)
    p.outputs = tuple(new if o == old else o for o in p.outputs)


def _drop_instr(p: Program, i: int, bypass: bool) -> Program | None:
    q = p.copy()
    types = check(p)
    ins = q.instrs.pop(i)
    for o in ins.outs:
        users = any(o in x.args for x in q.instrs[i:])
        if not users and o in q.outputs and len(q.outputs) > 1:
            q.outputs = tuple(x for x in q.outputs if x != o)
            if q.out_strategy is not None:
                q.out_strategy = tuple(s for x, s in zip(p.outputs, p.out_strategy) if x != o)
            continue
        if not users and o in q.outputs:
            return None                   # the only output: a program returning an input shows nothing
        same = [a for a in ins.args if types[a] == types[o]]
        if bypass and not same:
            return None
        new = same[0] if bypass else _fresh_input(q, types[o])
        _replace_uses(q, o, new, i)
    return q


def _unused_inputs(p: Program) -> list:
    used = {a for ins in p.instrs for a in ins.args} | set(p.outputs) | set(p.params)
    return [n for n in p.inputs if n not in used]


def _drop_block(p: Program, lo: int, hi: int) -> Program | None:
    """Instructions lo..hi-1 gone; what later instructions read from them becomes new inputs."""
    q = p
    for i in reversed(range(lo, hi)):
        q = _drop_instr(q, i, bypass=False)
        if q is None:
            return None
    return q


def candidates(p: Program) -> Iterator[Program]:
    n = len(p.instrs)
    width = n // 2
    while width >= 2:                       # big cuts first: halves, quarters, ...
        for lo in range(0, n - width + 1, width):
            try:
                q = _drop_block(p, lo, lo + width)
            except Inconsistent:
                q = None
            if q is not None:
                yield q
        width //= 2
    simpler = {"adam": "sgd", "sgd": "grad", "grad": "fwd"}
    if p.wrapper in simpler:
        q = p.copy()
        q.wrapper = simpler[p.wrapper]
        if q.wrapper == "grad":
            q.params = ()
        yield q
    if p.memory_share is not None:
        q = p.copy()
        q.memory_share = None
        yield q
    if p.mode != "sharding_propagation":
        q = p.copy()
        q.mode, q.memory_share = "sharding_propagation", None   # (a memory limit is mode="auto"'s)
        yield q
    if p.out_strategy is not None:
        q = p.copy()
        q.out_strategy = None
        yield q
    if p.in_strategy:
        q = p.copy()
        q.in_strategy = {}
        yield q
        for name in p.in_strategy:
            q = p.copy()
            del q.in_strategy[name]
            yield q
    for i, ins in enumerate(p.instrs):
        if ins.mark is not None:
            q = p.copy()
            q.instrs[i].mark = None
            yield q
            if ins.mark.outs is not None:
                q = p.copy()
                q.instrs[i].mark = type(ins.mark)(ins.mark.ins, None)
                yield q
    for i in reversed(range(len(p.instrs))):
        for bypass in (True, False):
            try:
                q = _drop_instr(p, i, bypass)
            except Inconsistent:
                q = None
            if q is not None:
                yield q
    if len(p.outputs) > 1:
        for o in p.outputs:
            q = p.copy()
            q.outputs = tuple(x for x in p.outputs if x != o)
            if p.out_strategy is not None:
                q.out_strategy = tuple(s for x, s in zip(p.outputs, p.out_strategy) if x != o)
            yield q
    for name in _unused_inputs(p):
        q = p.copy()
        del q.inputs[name]
        q.in_strategy.pop(name, None)
        yield q
    if isinstance(p.mesh, int) and p.mesh > 2:
        q = p.copy()
        q.mesh = p.mesh // 2
        yield q
    yield from _smaller_shapes(p)


def _smaller_shapes(p: Program) -> Iterator[Program]:
    sizes = sorted({d for t in p.inputs.values() for d in t.shape if d > 1}, reverse=True)
    for s in sizes:                       # one size everywhere (keeps elementwise operands matching)
        for t in sorted({1, 2, s // 2} - {s}):
            if t >= 1:
                q = p.copy()
                q.inputs = {n: TType(tuple(t if d == s else d for d in x.shape), x.dtype, x.hi)
                            for n, x in p.inputs.items()}
                yield q
    for n, x in p.inputs.items():         # one dim of one input
        for d, size in enumerate(x.shape):
            for t in sorted({1, 2, size // 2} - {size}):
                if 1 <= t < size:
                    q = p.copy()
                    q.inputs[n] = TType(x.shape[:d] + (t,) + x.shape[d + 1:], x.dtype, x.hi)
                    yield q


def _returns_inputs(p: Program) -> int:
    return sum(o in p.inputs for o in p.outputs)


def size_of(p: Program) -> tuple:
    """What shrinking makes smaller, most important first."""
    marks = sum(i.mark is not None for i in p.instrs)
    elems = sum(t.size for t in p.inputs.values())
    return (len(p.instrs), marks, len(p.in_strategy) + (p.out_strategy is not None), p.wrapper != "fwd",
            p.mode != "sharding_propagation", p.memory_share is not None, len(p.outputs), len(p.inputs),
            p.n_devices, elems)


def shrink(p: Program, fails: Callable[[Program], bool], budget_s: float = 120.0, max_tries: int = 300) -> Program:
    """Greedy: take the first simpler candidate that still fails, until none does."""
    status = expect(p).status
    deadline = time.monotonic() + budget_s
    tries = 0
    progress = True
    while progress and tries < max_tries and time.monotonic() < deadline:
        progress = False
        for q in candidates(p):
            if tries >= max_tries or time.monotonic() > deadline:
                break
            try:
                check(q)
                if expect(q).status != status or size_of(q) >= size_of(p) or _returns_inputs(q) > _returns_inputs(p):
                    continue
            except (Inconsistent, KeyError, ValueError, IndexError):
                continue
            tries += 1
            if fails(q):
                p, progress = q, True
                break
    return p
