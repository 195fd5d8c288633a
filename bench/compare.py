"""shardprop against JAX's own partitioner, side by side in one run.

For every case in ``bench/zoo.py`` the same marks go to (a) shardprop and (b)
``jax.jit`` with the marked operators' inputs constrained by
``with_sharding_constraint`` and everything else left to XLA (free inputs arrive
replicated, as a user's params usually do). A training step's state (params,
optimizer state) is the exception: it arrives in the layouts shardprop keeps it
in, both programs must return it in those layouts, and the timed runs are a
training loop that feeds it back, so both solve the same problem between steps.
Read from each compiled program:
collectives by kind and the bytes each device moves per step (ring formulas,
see bench/hlo.py), peak memory per device (argument + output + temp - alias from
``memory_analysis``), compile times, and the median step time over interleaved
runs (A, B, A, B, ...) as the ratio A / B. Both results are checked against one
device (float32, 1e-4 relative: whole training steps).

    python bench/compare.py                  # every case (a few minutes)
    python bench/compare.py --quick          # fewer timing repetitions
    python bench/compare.py --cases seed_network megatron_mlp
    python bench/compare.py --auto --hand --limits 0.5,0.7,0.9   # auto under memory limits against the
                                             # hand plans that fit (FSDP, tp+FSDP included)
    python bench/compare.py --auto --hand    # mode="auto" on the unmarked program against XLA and
                                             # the hand plans (results/auto.txt on a whole run)

Prints the table; a run of every case also writes it to bench/results/compare.txt
(and the rows to compare.json). On forced CPU devices
collectives are memcpys and timings are noisy: read ratios, not milliseconds.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bench import zoo  # noqa: E402
from bench.hlo import collectives, peak_memory  # noqa: E402
import shardprop as sp  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def median_interleaved(fa, fb, reps: int) -> tuple[float, float]:
    for f in (fa, fb):          # warm-up
        jax.block_until_ready(f())
    ta, tb = [], []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fa())
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(fb())
        tb.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)


def median_interleaved_all(fns: list, reps: int) -> list[float]:
    """Median seconds of each of ``fns``, run in turns, each round starting one later
    (f1, f2, f3, then f2, f3, f1, ...): where a program runs in the round (after which
    other program) changes its time, so every position is taken in turn."""
    for f in fns:               # warm-up
        jax.block_until_ready(f())
    times = [[] for _ in fns]
    for r in range(reps):
        for k in range(len(fns)):
            i = (r + k) % len(fns)
            t = time.perf_counter()
            jax.block_until_ready(fns[i]())
            times[i].append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]


# The hand plans a performance engineer would write, per case: the case's own marks
# (Megatron, dp x mp, data parallel for the CNN), data parallel over every device
# (the batch arguments split on dim 0), and ZeRO-1 (data parallel with Adam's state
# split) where the step has an optimizer state.
BATCH_ARGNUMS = {"seed_network": (0,), "seed_network_4096x1024": (0,), "mindspore_ffn": (0,), "megatron_mlp": (0,), "megatron_attention": (0,),
                 "cnn_data_parallel": (1, 2)}


def hand_plans(case: zoo.Case) -> dict:
    """name -> (annotate mode, parallelize keywords)."""
    batch = BATCH_ARGNUMS.get(case.name, (2, 3) if case.name.startswith("gpt") else None)
    plans = {"marks": ("shardprop", {})}
    if batch is not None:
        plans["DP"] = ("plain", dict(mode="data_parallel", batch_argnums=batch))
    if case.name.startswith("gpt"):   # Adam: params, state, tokens, targets
        plans["ZeRO-1"] = ("plain", dict(mode="data_parallel", batch_argnums=batch, shard_optimizer_state=True,
                                         optimizer_argnums=(1,)))
    return plans


def program_text(compiled) -> str:
    """A compiled program's HLO without its name and debug information (op metadata, and
    the tables of source files, functions and stack frames it points into): equal texts
    are the same program, whichever function, plan or mode produced it."""
    text = re.sub(r"^HloModule [^,]+", "HloModule", compiled.as_text())
    text = re.sub(r",? ?metadata=\{[^}]*\}", "", text)
    return re.sub(r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n(.+\n)*", "\n", text)


def fresh(fn):
    """A new function object for ``fn``: jax and shardprop cache traces by function, and
    ``zoo.annotate``'s mode (marks or none) is not part of that key."""
    return functools.wraps(fn)(lambda *a: fn(*a))


def hand_step(case: zoo.Case, mesh, args, reference, annotate_mode: str, kw: dict):
    """A hand plan's training loop (its state fed back in its own layouts), and whether
    its result equals one device's."""
    zoo.annotate.mode, zoo.annotate.mesh = annotate_mode, mesh
    pf = sp.parallelize(fresh(case.fn), mesh=mesh, donate_argnums=case.state_argnums, progress=False, **kw)
    plan = pf.plan(*args)
    comp = pf.lower(*args).compile()
    compiled = pf._compile(args, {})
    step = feedback(comp, pf._flat_inputs(compiled, args, {}), plan.graph.tied_outputs)
    out = jax.tree_util.tree_unflatten(compiled.out_tree, list(step()))
    return step, close(out, reference, case.train), comp


def feedback(step, inputs: list, ties: dict):
    """A training loop: each call runs ``step`` on the live inputs, then the state
    outputs replace the inputs they stand for (output index -> input index)."""
    live = list(inputs)

    def run():
        outs = step(*live)
        for o, i in ties.items():
            live[i] = outs[o]
        return outs
    return run


def close(got, want, train: bool) -> bool:
    # After an Adam step, parameters whose gradient is ~0 amplify rounding (any reduction
    # order, XLA's too) to ~1e-4; the loss itself agrees to 1e-5.
    atol = 2e-4 if train else 1e-5
    ok = True
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        ok &= bool(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=atol))
    return ok


def run_case(case: zoo.Case, reps: int) -> dict:
    shape, names = case.mesh
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))
    n = mesh.devices.size
    args = case.args()
    row = {"case": case.name, "note": case.note, "mesh": "x".join(map(str, shape))}

    zoo.annotate.mode = "plain"
    reference = jax.jit(case.fn)(*args)          # one device, no marks
    zoo.annotate.mesh = mesh

    # (a) shardprop; a training step's state comes back in the layout it went in (and
    # both systems' timings run a training loop that feeds it back)
    zoo.annotate.mode = "shardprop"
    try:
        pf = sp.parallelize(case.fn, mesh=mesh, donate_argnums=case.state_argnums)
        plan = pf.plan(*args)
    except sp.ShardingError as e:
        row["unsupported"] = str(e).splitlines()[0]
        return row
    row["ours_passes_s"] = plan.trace_seconds + sum(plan.pass_seconds.values())
    lowered = pf.lower(*args)
    t = time.perf_counter()
    comp_a = lowered.compile()
    row["xla_compile_a_s"] = time.perf_counter() - t
    compiled = pf._compile(args, {})
    step_a = feedback(comp_a, pf._flat_inputs(compiled, args, {}), plan.graph.tied_outputs)
    out_a = jax.tree_util.tree_unflatten(compiled.out_tree, list(step_a()))

    # (b) XLA with the same marks as constraints
    zoo.annotate.mode = "xla"
    replicated = NamedSharding(mesh, P())
    flat_b, tree = jax.tree_util.tree_flatten(args)
    ties = plan.graph.tied_outputs
    if case.train:
        # the training state arrives in the layouts shardprop keeps it in, and both must
        # return it so (what stays on the devices between steps is the same problem)
        in_b = compiled.in_shardings[:len(flat_b)]
        outs = [in_b[ties[o]] if o in ties else replicated for o in range(len(jax.tree_util.tree_leaves(out_a)))]
        out_shardings = jax.tree_util.tree_unflatten(compiled.out_tree, outs)
    else:
        in_b = [replicated] * len(flat_b)
    flat_b = [jax.device_put(x, s) for x, s in zip(flat_b, in_b)]
    args_b = jax.tree_util.tree_unflatten(tree, flat_b)
    with jax.set_mesh(mesh):
        jitted = jax.jit(case.fn, out_shardings=out_shardings, donate_argnums=case.state_argnums) if case.train \
            else jax.jit(case.fn)
        lowered_b = jitted.lower(*args_b)
        t = time.perf_counter()
        comp_b = lowered_b.compile()
        row["xla_compile_b_s"] = time.perf_counter() - t
        step_b = feedback(comp_b, list(args_b), {o: i for o, i in enumerate(case.state_argnums)})
        out_b = step_b()

    row["correct_a"] = close(out_a, reference, case.train)
    row["correct_b"] = close(out_b, reference, case.train)
    ca, cb = collectives(comp_a.as_text(), n), collectives(comp_b.as_text(), n)
    row.update(collectives_a=dict(ca.counts), collectives_b=dict(cb.counts), bytes_a=ca.bytes, bytes_b=cb.bytes,
               summary_a=ca.summary(), summary_b=cb.summary(),
               floor_bytes=case.floor_bytes() if case.floor_bytes else None,
               memory_a=peak_memory(comp_a), memory_b=peak_memory(comp_b))
    with jax.set_mesh(mesh):
        ta, tb = median_interleaved(step_a, step_b, reps)
    row.update(step_a_ms=ta * 1e3, step_b_ms=tb * 1e3, step_ratio=ta / tb)
    return row


def run_auto(case: zoo.Case, reps: int, cost_model, hand: bool = False) -> dict:
    """(c) shardprop's ``mode="auto"`` on the unmarked program against (b) XLA with the
    marks: the modeled and measured step, bytes and memory, interleaved with XLA's step."""
    shape, names = case.mesh
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))
    n = mesh.devices.size
    args = case.args()
    host = jax.tree_util.tree_map(np.array, args)   # donated state is deleted: each plan gets its copy
    zoo.annotate.mode = "plain"
    reference = jax.jit(case.fn)(*args)
    row = {"case": case.name}
    pf = sp.parallelize(case.fn, mesh=mesh, mode="auto", donate_argnums=case.state_argnums, progress=False,
                        cost_model=cost_model)
    plan = pf.plan(*args)
    row.update(search_s=plan.pass_seconds["search-strategies"], modeled_ms=plan.cost.step_time * 1e3,
               modeled_bytes=plan.cost.bytes_moved, modeled_peak=plan.cost.peak_memory)
    comp_c = pf.lower(*args).compile()
    compiled = pf._compile(args, {})
    step_c = feedback(comp_c, pf._flat_inputs(compiled, args, {}), plan.graph.tied_outputs)
    out_c = jax.tree_util.tree_unflatten(compiled.out_tree, list(step_c()))
    row["correct_c"] = close(out_c, reference, case.train)
    cc = collectives(comp_c.as_text(), n)
    row.update(summary_c=cc.summary(), bytes_c=cc.bytes, memory_c=peak_memory(comp_c))
    auto_program = program_text(comp_c)

    # (b) XLA with the marks, its state arriving in the layouts auto keeps it in
    zoo.annotate.mode, zoo.annotate.mesh = "xla", mesh
    replicated = NamedSharding(mesh, P())
    flat_b, tree = jax.tree_util.tree_flatten(args)
    ties = plan.graph.tied_outputs
    out_shardings = None
    if case.train:
        in_b = compiled.in_shardings[:len(flat_b)]
        outs = [in_b[ties[o]] if o in ties else replicated for o in range(len(jax.tree_util.tree_leaves(out_c)))]
        out_shardings = jax.tree_util.tree_unflatten(compiled.out_tree, outs)
    else:
        in_b = [replicated] * len(flat_b)
    args_b = jax.tree_util.tree_unflatten(tree, [jax.device_put(x, s) for x, s in zip(flat_b, in_b)])
    with jax.set_mesh(mesh):
        jitted = jax.jit(fresh(case.fn), out_shardings=out_shardings, donate_argnums=case.state_argnums) \
            if case.train else jax.jit(fresh(case.fn))
        comp_b = jitted.lower(*args_b).compile()
        step_b = feedback(comp_b, list(args_b),
                          {o: i for o, i in enumerate(case.state_argnums)})
        step_b()
        row.update(bytes_b=collectives(comp_b.as_text(), n).bytes, memory_b=peak_memory(comp_b))
        if not hand:
            tc, tb = median_interleaved(step_c, step_b, reps)
    if hand:   # every hand plan, timed in turns with auto and XLA
        steps, names = [step_c, step_b], []
        row["hand"] = {}
        for name, (mode, kw) in hand_plans(case).items():
            try:
                step, ok, comp = hand_step(case, mesh, jax.tree_util.tree_map(np.array, host), reference, mode, kw)
            except sp.ShardingError as e:
                row["hand"][name] = {"error": str(e).splitlines()[0]}
                continue
            steps.append(step)
            names.append(name)
            row["hand"][name] = dict(correct=ok, bytes=collectives(comp.as_text(), n).bytes, memory=peak_memory(comp),
                                     same_program=program_text(comp) == auto_program)
        # XLA without the marks: the unmarked program under jit, its inputs placed as (b)'s
        zoo.annotate.mode = "plain"
        flat_u = [jax.device_put(x, s) for x, s in zip(jax.tree_util.tree_leaves(host), in_b)]
        with jax.set_mesh(mesh):
            comp_u = jax.jit(fresh(case.fn), out_shardings=out_shardings, donate_argnums=case.state_argnums) \
                .lower(*jax.tree_util.tree_unflatten(tree, flat_u)).compile()
        steps.append(feedback(comp_u, list(jax.tree_util.tree_unflatten(tree, flat_u)),
                              {o: i for o, i in enumerate(case.state_argnums)}))
        with jax.set_mesh(mesh):
            times = median_interleaved_all(steps, reps)
        tc, tb = times[:2]
        row["step_xla_plain_ms"] = times[-1] * 1e3
        for name, t in zip(names, times[2:-1]):
            row["hand"][name]["step_ms"] = t * 1e3
        best = min(names, key=lambda k: row["hand"][k]["step_ms"]) if names else None
        row.update(best_hand=best, auto_vs_best_hand=tc * 1e3 / row["hand"][best]["step_ms"] if best else None)
    row.update(step_c_ms=tc * 1e3, step_b_ms=tb * 1e3, step_ratio_c=tc / tb)
    return row


# --limits: memory limits as fractions of the free plan's modeled peak; the hand plans
# that fit (compiled peak under the limit) against auto under each
PARAM_ARGNUMS = {"megatron_mlp": (1, 2), "megatron_attention": (1, 2, 3, 4), "seed_network": (1, 2),
                 "seed_network_4096x1024": (1, 2), "mindspore_ffn": (1, 2, 3, 4)}


def limited_hand_plans(case: zoo.Case) -> dict:
    """The hand plans of ``hand_plans`` and FSDP (``shard_params=True``: over every
    device) and tp+FSDP (the case's marks, parameters stored split over the rest)."""
    plans = dict(hand_plans(case))
    params = PARAM_ARGNUMS.get(case.name, (0,))
    batch = BATCH_ARGNUMS.get(case.name, (2, 3) if case.name.startswith("gpt") else None)
    if batch is not None:
        plans["FSDP"] = ("plain", dict(mode="data_parallel", batch_argnums=batch, shard_params=True,
                                       param_argnums=params))
    if len(case.mesh[0]) > 1:
        plans["tp+FSDP"] = ("shardprop", dict(shard_params=True, param_argnums=params))
    return plans


def run_limited(case: zoo.Case, reps: int, fracs: list, cost_model, measure: bool = False) -> list[dict]:
    """Per limit: auto's plan under it (search seconds, compiled peak, bytes) and the hand
    plans whose compiled peak fits, all timed in turns (interleaved medians). ``measure``:
    auto with ``measure=True`` (it times its close candidates itself and keeps the fastest)."""
    shape, names = case.mesh
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))
    n = mesh.devices.size
    args = case.args()
    host = jax.tree_util.tree_map(np.array, args)
    zoo.annotate.mode = "plain"
    reference = jax.jit(case.fn)(*args)
    free = sp.parallelize(fresh(case.fn), mesh=mesh, mode="auto", donate_argnums=case.state_argnums, progress=False,
                          cost_model=cost_model).plan(*jax.tree_util.tree_map(np.array, host))
    # the marks' plan priced by the model auto plans with (bench/auto_marks.py): as written, and
    # its modeled peak, beside auto's plan's written price in each row
    # (on auto's own problem: the marked graph's sharding constraints are priced as ops there)
    from bench.auto_marks import marks_on_the_problem, marks_plan, unmarked_problem
    marks = marks_plan(case, mesh, cost_model, jax.tree_util.tree_map(np.array, host))
    on_auto = marks_on_the_problem(unmarked_problem(case, mesh, cost_model, jax.tree_util.tree_map(np.array, host))[1],
                                   marks)
    marks["written"] = on_auto.get("written", marks["written"])
    marks["peak"] = on_auto.get("peak", marks["peak"])
    hands = {}
    for name, (mode, kw) in limited_hand_plans(case).items():
        try:
            step, ok, comp = hand_step(case, mesh, jax.tree_util.tree_map(np.array, host), reference, mode, kw)
        except sp.ShardingError as e:
            hands[name] = {"error": str(e).splitlines()[0]}
            continue
        hands[name] = dict(step=step, correct=ok, bytes=collectives(comp.as_text(), n).bytes, memory=peak_memory(comp))
    rows = []
    for frac in fracs:
        limit = int(frac * free.cost.peak_memory)
        row = {"case": case.name, "mesh": "x".join(map(str, shape)), "frac": frac, "limit": limit}
        zoo.annotate.mode = "plain"
        a = jax.tree_util.tree_map(np.array, host)
        try:
            pf = sp.parallelize(fresh(case.fn), mesh=mesh, mode="auto", donate_argnums=case.state_argnums,
                                progress=False, cost_model=cost_model, memory_limit=limit, measure=measure)
            t_plan = time.perf_counter()
            plan = pf.plan(*a)
            t_plan = time.perf_counter() - t_plan
            comp = pf.lower(*a).compile()
            compiled = pf._compile(a, {})
            step = feedback(comp, pf._flat_inputs(compiled, a, {}), plan.graph.tied_outputs)
            out = jax.tree_util.tree_unflatten(compiled.out_tree, list(step()))
        except sp.ShardingError as e:
            row["error"] = str(e).splitlines()[0]
            row["hands_fit"] = [k for k, h in hands.items() if "error" not in h and h["memory"] <= limit]
            rows.append(row)
            continue
        row.update(search_s=plan.pass_seconds["search-strategies"], plan_s=t_plan,
                   kept=next((m.name for m in plan.cost.measured if m.note == "kept"), None),
                   measured=[str(m) for m in plan.cost.measured],
                   modeled_peak=plan.cost.peak_memory,
                   memory=peak_memory(comp), bytes=collectives(comp.as_text(), n).bytes,
                   correct=close(out, reference, case.train), status=plan.cost.solver.get("status", ""),
                   gap=plan.cost.solver.get("gap", 0.0),
                   modeled_hands={h.name: (h.time, h.fits) for h in plan.cost.hand_plans},
                   auto_model_ms=(plan.cost.written_time or plan.cost.step_time) * 1e3,
                   marks_model_ms=marks["written"] * 1e3, marks_model_fits=marks["peak"] <= limit)
        fitting = [k for k, h in hands.items() if "error" not in h and h["memory"] <= limit]
        with jax.set_mesh(mesh):
            times = median_interleaved_all([step] + [hands[k]["step"] for k in fitting], reps)
        row["step_ms"] = times[0] * 1e3
        row["hand"] = {k: dict(step_ms=t * 1e3, bytes=hands[k]["bytes"], memory=hands[k]["memory"],
                               correct=hands[k]["correct"]) for k, t in zip(fitting, times[1:])}
        row["over"] = {k: h.get("memory") for k, h in hands.items() if k not in fitting}
        best = min(fitting, key=lambda k: row["hand"][k]["step_ms"]) if fitting else None
        row.update(best_hand=best, vs_best=times[0] * 1e3 / row["hand"][best]["step_ms"] if best else None,
                   bytes_vs_best=row["bytes"] / max(row["hand"][best]["bytes"], 1) if best else None)
        rows.append(row)
    return rows


def limits_table(rows: list[dict]) -> str:
    head = (f"{'case':<22} {'mesh':<4} {'limit':>5} {'search':>7} {'auto ms':>8} {'peak/limit':>10} {'XLA/model':>9} "
            f"{'auto bytes':>10} {'best hand':>9} {'hand ms':>8} {'hand bytes':>10} {'auto/best':>9} "
            f"{'model':>6} ok  hands that fit (ms)")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']:<22} {r['mesh']:<4} {r['frac']:>5} auto failed (hand plans that fit: "
                         f"{', '.join(r.get('hands_fit', [])) or 'none'}): {r['error']}")
            continue
        b = r["best_hand"]
        h = r["hand"].get(b, {}) if b else {}
        fit = ", ".join(f"{k} {v['step_ms']:.3f}" for k, v in r["hand"].items()) or "none"
        over = ", ".join(f"{k} {m / 2**20:.3f} MiB" for k, m in r.get("over", {}).items() if m is not None)
        fit += f"; over the limit ({r['limit'] / 2**20:.3f} MiB) once compiled: {over}" if over else ""
        lines.append(f"{r['case']:<22} {r['mesh']:<4} {r['frac']:>5} {r['search_s']:>6.2f}s {r['step_ms']:>8.3f} "
                     f"{r['memory'] / r['limit']:>10.2f} {r['memory'] / r['modeled_peak']:>9.2f} "
                     f"{fmt_bytes(r['bytes']):>10} {b or '-':>9} "
                     f"{h.get('step_ms', float('nan')):>8.3f} {fmt_bytes(h.get('bytes', 0)):>10} "
                     f"{(r['vs_best'] or float('nan')):>9.2f} {r['auto_model_ms'] / r['marks_model_ms']:>6.2f} "
                     f"{'yes' if r['correct'] else 'NO'}  {fit}")
    return "\n".join(lines)


def hand_table(rows: list[dict]) -> str:
    names = ["marks", "DP", "ZeRO-1"]
    head = f"{'case':<22} {'auto ms':>8} {'XLA ms':>8} {'XLA- ms':>8} " + " ".join(f"{n + ' ms':>10}" for n in names) + \
        f" {'best hand':>10} {'auto/best':>9} {'correct':>8}  auto's program is"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']:<22} error: {r['error']}")
            continue
        cells, ok = [], r["correct_c"]
        for n in names:
            h = r["hand"].get(n)
            cells.append(f"{'-':>10}" if h is None else f"{'n/a':>10}" if "error" in h else f"{h['step_ms']:>10.3f}")
            ok &= h is None or "error" in h or h["correct"]
        ratio = f"{r['auto_vs_best_hand']:>9.2f}" if r["auto_vs_best_hand"] else f"{'-':>9}"
        same = [n for n, h in r["hand"].items() if h.get("same_program")]
        lines.append(f"{r['case']:<22} {r['step_c_ms']:>8.3f} {r['step_b_ms']:>8.3f} {r['step_xla_plain_ms']:>8.3f} "
                     + " ".join(cells)
                     + f" {r['best_hand'] or '-':>10} {ratio} {str(ok):>8}  {', '.join(same) or '-'}")
        lines += [f"  {n} n/a: {h['error']}" for n, h in r["hand"].items() if "error" in h]
    return "\n".join(lines)


def auto_table(rows: list[dict]) -> str:
    head = (f"{'case':<22} {'auto collectives':<34} {'search':>7} {'model ms':>9} {'bytes C':>9} {'bytes B':>9} "
            f"{'mem C/B':>8} {'step C/B':>9} ok")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']:<22} auto failed: {r['error']}")
            continue
        lines.append(f"{r['case']:<22} {r['summary_c'][:34]:<34} {r['search_s']:>6.2f}s {r['modeled_ms']:>9.4f} "
                     f"{fmt_bytes(r['bytes_c']):>9} {fmt_bytes(r['bytes_b']):>9} {r['memory_c'] / r['memory_b']:>8.2f} "
                     f"{r['step_ratio_c']:>9.2f} {'yes' if r['correct_c'] else 'NO'}")
    return "\n".join(lines)


def fmt_bytes(b) -> str:
    if b is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if b < 1024 or unit == "GB":
            return f"{b:.0f}{unit}" if unit == "B" else f"{b:.1f}{unit}"
        b /= 1024


def table(rows: list[dict]) -> str:
    head = (f"{'case':<22} {'shardprop collectives':<34} {'XLA collectives':<34} {'bytes A':>9} {'bytes B':>9} "
            f"{'floor':>9} {'mem A/B':>8} {'passes':>7} {'XLA cA':>7} {'XLA cB':>7} {'step A/B':>9} ok")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "unsupported" in r:
            lines.append(f"{r['case']:<22} unsupported by shardprop: {r['unsupported']}")
            continue
        ok = "yes" if r["correct_a"] and r["correct_b"] else f"A:{r['correct_a']} B:{r['correct_b']}"
        lines.append(
            f"{r['case']:<22} {r['summary_a'][:34]:<34} {r['summary_b'][:34]:<34} {fmt_bytes(r['bytes_a']):>9} "
            f"{fmt_bytes(r['bytes_b']):>9} {fmt_bytes(r['floor_bytes']):>9} {r['memory_a'] / r['memory_b']:>8.2f} "
            f"{r['ours_passes_s']:>6.2f}s {r['xla_compile_a_s']:>6.2f}s {r['xla_compile_b_s']:>6.2f}s "
            f"{r['step_ratio']:>9.2f} {ok}")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if "unsupported" in r:
            continue
        if r["bytes_a"] > r["bytes_b"] * 1.001:
            out.append(f"{r['case']}: shardprop moves more bytes ({fmt_bytes(r['bytes_a'])} vs {fmt_bytes(r['bytes_b'])})")
        if r["floor_bytes"] and r["bytes_a"] > r["floor_bytes"] * 1.001:
            out.append(f"{r['case']}: shardprop is above the analytic floor ({fmt_bytes(r['bytes_a'])} vs "
                       f"{fmt_bytes(r['floor_bytes'])})")
        if r["memory_a"] > 1.03 * r["memory_b"]:
            out.append(f"{r['case']}: shardprop uses {r['memory_a'] / r['memory_b']:.2f}x XLA's peak memory")
        if r["step_ratio"] > 1.02:
            out.append(f"{r['case']}: shardprop's step is {r['step_ratio']:.2f}x XLA's")
        if r["ours_passes_s"] > r["xla_compile_b_s"]:
            out.append(f"{r['case']}: shardprop's passes ({r['ours_passes_s']:.2f}s) take longer than XLA's compile "
                       f"({r['xla_compile_b_s']:.2f}s)")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 timing repetitions instead of 21")
    ap.add_argument("--cases", nargs="*", help="run only these cases")
    ap.add_argument("--auto", action="store_true", help="mode='auto' on the unmarked program (C) against XLA "
                    "with the marks (B), instead of the marked comparison")
    ap.add_argument("--hand", action="store_true", help="(--auto) also the hand plans (the case's marks, data "
                    "parallel, ZeRO-1 where the step has Adam's state), all timed in turns with auto and XLA")
    ap.add_argument("--cost-model", default="cpu", help="(--auto) the cost model auto plans with: a built-in "
                    "profile name (default 'cpu': these forced CPU devices) or a `shardprop calibrate` file")
    ap.add_argument("--limits", help="(--auto --hand) memory limits as fractions of the free plan's modeled peak, "
                    "e.g. 0.5,0.7,0.9: auto under each against the hand plans whose compiled peak fits (FSDP and "
                    "tp+FSDP included)")
    ap.add_argument("--measure", action="store_true", help="(--limits) auto with measure=True: it compiles and "
                    "times the hand plans the model prices close to its own plan, and keeps the fastest")
    args = ap.parse_args()
    reps = 5 if args.quick else 21
    if args.auto and args.limits:
        if args.cost_model not in ("cpu", "h100", "default"):
            args.cost_model = sp.CostModel.load(args.cost_model)
        elif args.cost_model == "default":
            args.cost_model = None
        fracs = [float(f) for f in args.limits.split(",")]
        rows = []
        for case in zoo.cases() + zoo.limit_cases():
            if args.cases and case.name not in args.cases:
                continue
            print(f"... {case.name} (auto under limits {fracs})", file=sys.stderr, flush=True)
            rows += run_limited(case, reps, fracs, args.cost_model, measure=args.measure)
        print(limits_table(rows))
        if args.measure:
            print("\nmeasure=True: auto's plan() seconds (search, memory check, and the candidates compiled and "
                  "timed), and the plan it kept:")
            for r in rows:
                if "error" not in r:
                    print(f"  {r['case']} {r['frac']}: {r['plan_s']:.1f} s, kept {r['kept']}")
                    print("\n".join(f"      {m}" for m in r["measured"]))
        print(f"\nlimit: fraction of auto's free plan's modeled peak; peak/limit: auto's compiled peak "
              f"(memory_analysis) over the limit; XLA/model: that compiled peak over auto's modeled peak; a hand plan fits where its compiled peak is under the limit; "
              f"model: auto's plan over the marks' plan, both priced as written by the model auto plans with; "
              f"times: median of {reps} interleaved runs of auto and every hand plan that fits.")
        return
    if args.auto:
        if args.cost_model not in ("cpu", "h100", "default"):
            args.cost_model = sp.CostModel.load(args.cost_model)
        elif args.cost_model == "default":
            args.cost_model = None
        rows = []
        for case in zoo.cases():
            if args.cases and case.name not in args.cases:
                continue
            print(f"... {case.name} (auto)", file=sys.stderr, flush=True)
            try:
                rows.append(run_auto(case, reps, args.cost_model, hand=args.hand))
            except sp.ShardingError as e:
                rows.append({"case": case.name, "error": str(e).splitlines()[0]})
        lines = [auto_table(rows)]
        if args.hand:
            lines += ["", hand_table(rows),
                      f"\nmedian of {reps} runs per plan, all plans of a case in turns (each round starting one "
                      "plan later); XLA: jit with the marks as sharding constraints; XLA-: jit of the unmarked "
                      "program; marks: shardprop with the case's marks (Megatron, dp x mp, ...); DP: "
                      "mode='data_parallel'; ZeRO-1: DP with Adam's state split; auto/best: auto's step over the "
                      "fastest hand plan's; auto's program is: the hand plans whose compiled program (HLO without "
                      "metadata) is auto's."]
        lines.append(f"\nsearch: the strategy search's seconds; model ms: auto's modeled step; bytes: per device per "
                     f"step (ring formulas); mem C/B: peak per-device memory, auto / XLA with marks; step C/B: median "
                     f"of {reps} interleaved runs, auto / XLA with marks.")
        report = "\n".join(lines)
        print(report)
        if not args.cases and args.hand:   # the stored results are always a whole run
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / "auto.txt").write_text(report + "\n")
            (RESULTS / "auto.json").write_text(json.dumps(rows, indent=1, default=str))
        return
    start = time.perf_counter()
    rows = []
    for case in zoo.cases():
        if args.cases and case.name not in args.cases:
            continue
        print(f"... {case.name}", file=sys.stderr, flush=True)
        rows.append(run_case(case, reps))
    lines = [table(rows), "",
             "bytes: per device per step (ring formulas); mem A/B: peak per-device memory, shardprop / XLA; "
             "passes: shardprop's trace + passes; XLA cA / cB: XLA's compile of shardprop's program / of the "
             f"constrained program; step A/B: median of {reps} interleaved runs, shardprop / XLA."]
    losses = verdicts(rows)
    lines.append("\nwhere shardprop loses:" if losses else "\nshardprop loses nowhere on these cases.")
    lines += ["  " + v for v in losses]
    lines.append(f"\ntotal {time.perf_counter() - start:.0f}s")
    report = "\n".join(lines)
    print(report)
    RESULTS.mkdir(exist_ok=True)
    if not args.cases:   # the stored results are always a whole run
        (RESULTS / "compare.txt").write_text(report + "\n")
        (RESULTS / "compare.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
