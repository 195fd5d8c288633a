"""A program as a runnable Python snippet. The fuzzer executes exactly this text,
so a saved repro is the program that ran, and error messages name its lines."""
from __future__ import annotations

import re
from dataclasses import dataclass

from .ops import FAMILIES
from .program import FLOAT, INT, KEY, RAWKEY, Inconsistent, Program, infer

LETTERS = "abcdefgh"


def strategy_text(s) -> str:
    if s is None:
        return "None"
    kind, body = s
    if kind == "s":
        return "(" + ", ".join(map(str, body)) + ("," if len(body) == 1 else "") + ")"
    def entry(e):
        if e is None:
            return "None"
        if isinstance(e, str):
            return repr(e)
        return "(" + ", ".join(map(repr, e)) + ("," if len(e) == 1 else "") + ")"
    return "P(" + ", ".join(entry(e) for e in body) + ")"


def strategies_text(ss) -> str:
    items = [strategy_text(s) for s in ss]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


@dataclass
class Rendered:
    source: str
    filename: str
    mark_lines: dict          # instr index -> line of its marked call
    call_line: int            # the line in run() that calls the parallel function


def check(program: Program) -> dict:
    """Types of every value; raises Inconsistent for a program that cannot be rendered."""
    types = infer(program)
    floats_in = [n for n, t in program.inputs.items() if t.dtype == FLOAT]
    floats_out = [o for o in program.outputs if types[o].dtype == FLOAT]
    if program.wrapper != "fwd" and not (floats_in and floats_out):
        raise Inconsistent("a gradient needs float inputs and a float output")
    if program.wrapper in ("sgd", "adam"):
        if not program.params or any(program.inputs.get(n) is None or program.inputs[n].dtype != FLOAT
                                     for n in program.params):
            raise Inconsistent("training needs float params")
    if program.wrapper not in ("fwd",) and any(i.op == "loop" and i.params["kind"] == "while" for i in program.instrs):
        raise Inconsistent("while_loop is not reverse differentiable")
    if program.out_strategy is not None and len(program.out_strategy) != len(program.outputs):
        raise Inconsistent("out_strategy entries")
    return types


def _call(instr, names, types, tag, marked):
    fam = FAMILIES[instr.op]
    ts = [types[a] for a in instr.args]
    if not marked:
        return fam.render(instr.params, list(names), ts, tag)
    params = LETTERS[:len(names)]
    prelude, expr = fam.render(instr.params, list(params), ts, tag)
    m = re.fullmatch(r"([\w.]+)\((.*)\)", expr)
    if m and m.group(2) == ", ".join(params):
        fn = m.group(1)
    else:
        fn = f"lambda {', '.join(params)}: {expr}"
    mark = instr.mark
    outs = f", {strategies_text(mark.outs)}" if mark.outs is not None else ""
    return prelude, f"sp.shard({fn}, {strategies_text(mark.ins)}{outs})({', '.join(names)})"


def render(program: Program, filename: str = None) -> Rendered:
    types = check(program)
    filename = filename or f"fuzz_{program.seed}_{program.index}.py"
    names = list(program.inputs)
    L = []
    add = L.append
    add(f'"""Fuzz program: seed {program.seed}, index {program.index}. Reproduce with')
    add(f"python -m tests.fuzz --seed {program.seed} --index {program.index}")
    if program.planted:
        add(f"Invalid on purpose: {program.planted}.")
    add('"""')
    add("import os")
    add('os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")')
    add("import jax")
    add("import jax.numpy as jnp")
    add("import numpy as np")
    add("import optax")
    add("from jax.sharding import PartitionSpec as P")
    add("")
    add("import shardprop as sp")
    add("")
    add("")
    add(f"def f({', '.join(names)}):")
    mark_lines = {}
    for i, ins in enumerate(program.instrs):
        prelude, expr = _call(ins, ins.args, types, str(i), ins.mark is not None)
        for line in prelude:
            add("    " + line)
        lhs = ", ".join(ins.outs)
        add(f"    {lhs} = {expr}" + ("    # result unused" if ins.unused else ""))
        if ins.mark is not None:
            mark_lines[i] = len(L)
    add(f"    return {', '.join(program.outputs)}" + ("," if len(program.outputs) == 1 else ""))
    add("")
    add("")
    w = program.wrapper
    floats_out = [k for k, o in enumerate(program.outputs) if types[o].dtype == FLOAT]
    loss = " + ".join(f"jnp.mean(jnp.square(outs[{k}]))" for k in floats_out)
    if w == "fwd":
        add("step = f")
        args = names
    elif w == "grad":
        argnums = tuple(k for k, n in enumerate(names) if program.inputs[n].dtype == FLOAT)
        add(f"def loss({', '.join(names)}):")
        add(f"    outs = f({', '.join(names)})")
        add(f"    return {loss}")
        add("")
        add("")
        add(f"step = jax.value_and_grad(loss, argnums={strategies_text_ints(argnums)})")
        args = names
    else:
        batch = [n for n in names if n not in program.params]
        opt = "optax.sgd(0.1)" if w == "sgd" else "optax.adam(1e-2, eps=1e-3)"
        add(f"opt = {opt}")
        add("")
        add("")
        add(f"def loss({', '.join(['params'] + batch)}):")
        add(f"    outs = f({', '.join(f'params[{n!r}]' if n in program.params else n for n in names)})")
        add(f"    return {loss}")
        add("")
        add("")
        add(f"def step({', '.join(['params', 'opt_state'] + batch)}):")
        add(f"    value, grads = jax.value_and_grad(loss)({', '.join(['params'] + batch)})")
        add("    updates, opt_state = opt.update(grads, opt_state, params)")
        add("    return optax.apply_updates(params, updates), opt_state, value")
        args = ["params", "opt_state"] + batch
    add("")
    add("")
    kw = [f"mesh={program.mesh!r}"]
    if program.mode != "sharding_propagation":
        kw.append(f"mode={program.mode!r}")
    if program.in_strategy or program.bad_in_structure:
        entries = [program.in_strategy.get(n) for n in args] if w in ("fwd", "grad") else \
            [None, None] + [program.in_strategy.get(n) for n in args[2:]]
        if program.bad_in_structure:
            entries.append(None)
        kw.append(f"in_strategy={strategies_text(entries)}")
    if program.out_strategy is not None or program.bad_out_structure:
        entries = list(program.out_strategy or (None,) * len(program.outputs))
        if program.bad_out_structure:
            entries.append(None)
        kw.append(f"out_strategy={strategies_text(entries)}")
    if w in ("sgd", "adam"):
        kw.append("donate_argnums=(0, 1)")
    if program.memory_share is None:
        add(f"parallel = sp.parallelize(step, {', '.join(kw)})")
    else:
        add(f"free = sp.parallelize(step, {', '.join(kw)})")
        add("limited = []")
        add("")
        add("")
        add("def parallel(*args):")
        add(f'    """mode="auto" under memory_limit = {program.memory_share:g} of the free plan\'s modeled peak"""')
        add("    if not limited:")
        add("        peak = free.plan(*make_inputs()).cost.peak_memory")
        add(f"        limited.append(sp.parallelize(step, {', '.join(kw)}, "
            f"memory_limit=max(1, int({program.memory_share:g} * peak))))")
        add("    return limited[0](*args)")
    add("")
    add("")
    add("def make_inputs():")
    add(f"    rng = np.random.default_rng([{program.seed}, {program.index}])")
    for k, (n, t) in enumerate(program.inputs.items()):
        if t.dtype == FLOAT:
            add(f"    {n} = np.asarray(rng.standard_normal({t.shape}), np.float32)")
        elif t.dtype == INT:
            add(f"    {n} = rng.integers(0, {t.hi}, {t.shape}).astype(np.int32)")
        elif t.dtype == KEY:
            add(f"    {n} = jax.random.key({k + 1})")
        elif t.dtype == RAWKEY:
            add(f"    {n} = jax.random.PRNGKey({k + 1})")
    if w in ("sgd", "adam"):
        add(f"    params = {{{', '.join(f'{n!r}: {n}' for n in program.params)}}}")
        add(f"    return {', '.join(['params', 'opt.init(params)'] + args[2:])}")
    else:
        add(f"    return {', '.join(names)}" + ("," if len(names) == 1 else ""))
    add("")
    add("")
    add("def run(fn, args):")
    if w in ("sgd", "adam"):
        add("    params, opt_state, *batch = args")
        add("    params, opt_state, loss1 = fn(params, opt_state, *batch)")
        call_line = len(L)
        add("    params, opt_state, loss2 = fn(params, opt_state, *batch)   # the state fed back")
        add("    return loss1, loss2, params, opt_state")
    else:
        add("    return fn(*args)")
        call_line = len(L)
    add("")
    add("")
    add('if __name__ == "__main__":')
    from .strategies import INVALID, expect
    if expect(program, types).status == INVALID:
        add("    try:")
        add("        run(parallel, make_inputs())")
        add("    except sp.ShardingError as e:")
        add("        print(e)")
        add("    else:")
        add('        raise SystemExit("an invalid strategy was accepted")')
    else:
        add("    want = run(jax.jit(step), make_inputs())")
        add("    got = run(parallel, make_inputs())")
        add("    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):")
        add("        g, w = np.asarray(g), np.asarray(w)")
        add("        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)")
        add("        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(w).max(initial=0))))")
        add('    print("parallel == single device")')
    return Rendered("\n".join(L) + "\n", filename, mark_lines, call_line)


def strategies_text_ints(xs) -> str:
    xs = tuple(xs)
    return "(" + ", ".join(map(str, xs)) + ("," if len(xs) == 1 else "") + ")"
