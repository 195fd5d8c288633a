"""FSDP's memory per device: what XLA allocates against what FSDP should hold.

For GPT training steps (examples/gpt_megatron.py, the zoo's widths: embed 128, 8
heads, seq 32 (--seq), batch 8, vocab 256; Adam; params and state donated) of
--layers layers, two plans:

- FSDP: ``mode="data_parallel", shard_params=True`` on 8 devices (no marks);
- tp+FSDP: Megatron's marks on a 2 x 4 (dp x mp) mesh, ``shard_params=True``.

Per plan and depth it prints ``memory_analysis()`` of the compiled step
(arguments, outputs, temp, aliased; peak = arguments + outputs + temp - aliased),
and what FSDP should hold: the state stored split (the arguments), two layers'
gathered weights (each weight at its layout at use, per device), and the
activations the backward reads (jax.vjp's residuals that carry the batch dim,
over the dp devices). ``bound`` is their sum; ``over`` is peak - bound. Then
the modeled peak (passes/auto/memory.py ``plan_peak`` of the plan's strategies),
modeled / compiled, and how many of the compiled program's all-gathers XLA
scheduled before its first computation (at the program's start).

    python bench/fsdp_memory.py                    # 2, 6, 12 layers, both plans
    python bench/fsdp_memory.py --layers 6 --plans fsdp --seq 8   # activations small beside the weights
    python bench/fsdp_memory.py --mixed --layers 6 12   # gpt_plan's GPT: bf16 casts, jax.checkpoint
    python bench/fsdp_memory.py --time 20 --layers 12 --seq 8   # step times against no FSDP
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __name__ == "__main__":    # (tests/test_fsdp_memory.py imports the helpers below)
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import gpt_megatron as G  # noqa: E402
from bench.hlo import opcodes, peak_memory  # noqa: E402
import shardprop as sp  # noqa: E402

FSDP_MESH, TP_MESH = ((8,), ("dp",)), ((2, 4), ("dp", "mp"))


def config(layers: int, seq: int = 32) -> G.Config:
    return G.Config(layers=layers, batch=8, seq=seq, heads=8, head_dim=16, vocab=256)


def case(layers: int, plan: str, cfg: G.Config = None):
    """(parallel step, its arguments, dp size, the same step without FSDP) of one plan."""
    cfg = cfg or config(layers)
    if plan == "fsdp":
        # no marks: every shard() of the example is the function itself
        step, opt = G.adam_train_step(lambda p, t, y: _unmarked_loss(p, t, y, cfg))
        kw = dict(mesh=FSDP_MESH, mode="data_parallel", batch_argnums=(2, 3))
        dp = 8
    else:
        par = G.Parallelism.data_and_tensor()
        step, opt = G.make_train_step(par, cfg)
        kw = dict(mesh=TP_MESH)
        dp = 2
    params = G.init_params(cfg)
    tokens, targets = G.make_batch(cfg)
    args = (params, opt.init(params), tokens, targets)
    fsdp = sp.parallelize(step, shard_params=True, donate_argnums=(0, 1), progress=False, **kw)
    plain = sp.parallelize(step, donate_argnums=(0, 1), progress=False, **kw)
    return fsdp, args, dp, plain


def _unmarked_loss(params, tokens, targets, cfg):
    real = G.sp
    G.sp = _NoMarks()
    try:
        return G.loss_fn(params, tokens, targets, G.Parallelism(heads=None, columns=None), cfg)
    finally:
        G.sp = real


class _NoMarks:
    @staticmethod
    def shard(fn, *specs):
        return fn


def activation_bytes(cfg: G.Config, dp: int) -> float:
    """Bytes per device of what the backward reads: the residuals of jax.vjp of the loss
    that carry the batch dim (the weights it also keeps are not activations), the
    batch split over ``dp`` devices."""
    params = G.init_params(cfg)
    tokens, targets = G.make_batch(cfg)
    _, back = jax.vjp(lambda p: _unmarked_loss(p, tokens, targets, cfg), params)
    residuals = {id(x): x for x in jax.tree_util.tree_leaves(back) if getattr(x, "ndim", 0) and x.shape[0] == cfg.batch}
    return sum(x.nbytes for x in residuals.values()) / dp


def layer_gathered_bytes(plain_plan, mesh) -> float:
    """Bytes per device of one layer's weights at their layouts at use (the plan
    without FSDP): what gathering a layer holds."""
    g = plain_plan.graph
    layer = [v for n, v in zip(g.input_names, g.inputs) if n.startswith("params['layers'][0]")]
    return float(sum(np.prod(v.layout.local_shape(v.type.shape, mesh)) * v.type.itemsize for v in layer))


def modeled_peak(pstep, args) -> float:
    """passes/auto/memory.py's modeled peak of the plan's strategies (the graph after
    binding and propagation, before the redistributions are written out)."""
    from shardprop.compiler.pipeline import default_passes
    from shardprop.passes.auto.memory import plan_peak
    graph, _ = pstep._trace(args, {})
    bind, choose = default_passes(pstep.options)[:2]
    graph = choose(bind(graph))
    ops = {op: op.strategy for op in graph.ops}
    return plan_peak(graph, ops, {i: v.layout for i, v in enumerate(graph.inputs)})


def gathers_at_start(hlo_text: str) -> tuple[int, int]:
    """(all-gathers XLA schedules before the program's first computation, all-gathers):
    read off the compiled entry computation, whose instruction order is the schedule."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    started, before, total = False, 0, 0
    for op in opcodes(entry).values():      # in program order
        if op == "all-gather":
            total += 1
            before += not started
        elif op.startswith("fusion") or op in ("dot", "convolution"):
            started = True
    return before, total


def measure(layers: int, plan: str, seq: int = 32) -> dict:
    cfg = config(layers, seq)
    pstep, args, dp, plain = case(layers, plan, cfg)
    compiled = pstep.lower(*args).compile()
    m = compiled.memory_analysis()
    row = dict(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes, temp=m.temp_size_in_bytes,
               aliased=m.alias_size_in_bytes, peak=peak_memory(compiled))
    row["gathers_at_start"], row["gathers"] = gathers_at_start(compiled.as_text())
    plain_plan = plain.plan(*args)
    row["two_layers"] = 2 * layer_gathered_bytes(plain_plan, plain_plan.mesh)
    row["activations"] = activation_bytes(cfg, dp)
    row["bound"] = row["arguments"] + row["two_layers"] + row["activations"]
    row["modeled"] = modeled_peak(pstep, args)
    return row


def measure_mixed(layers: int, dtype: str) -> dict:
    """examples/gpt_plan.py's GPT (hidden 128, 8 heads, seq 8, batch 8, vocab 256; each
    layer under jax.checkpoint, its weights cast to ``dtype`` where it starts) under
    FSDP on 8 devices: the compiled step's memory and where its gathers run."""
    import jax.numpy as jnp
    import gpt_plan as GP
    cfg = GP.GPT(layers=layers, hidden=128, heads=8, seq=8, vocab=256, batch=8, compute_dtype=dtype, dp="dp", mp=None)
    step, shapes = GP.train_step_and_args(cfg)
    rng = np.random.default_rng(0)
    args = jax.tree_util.tree_map(lambda s: rng.integers(0, cfg.vocab, s.shape).astype(s.dtype) if s.dtype == jnp.int32
                                  else (rng.standard_normal(s.shape) * 0.02).astype(s.dtype), shapes)
    pstep = sp.parallelize(step, mesh=FSDP_MESH, shard_params=True, donate_argnums=(0, 1), progress=False)
    compiled = pstep.lower(*args).compile()
    m = compiled.memory_analysis()
    row = dict(arguments=m.argument_size_in_bytes, temp=m.temp_size_in_bytes, peak=peak_memory(compiled))
    row["gathers_at_start"], row["gathers"] = gathers_at_start(compiled.as_text())
    return row


def time_against_plain(layers: int, plan: str, seq: int, reps: int) -> tuple:
    """Median seconds of the FSDP step and of the same step without FSDP, run in turns as
    a training loop (each feeds its params and state back)."""
    import statistics
    import time
    fsdp, args, _, plain = case(layers, plan, config(layers, seq))
    loops = []
    for f in (fsdp, plain):
        state = list(jax.tree_util.tree_map(np.array, args))
        out = f(*state)                       # compile and warm up
        jax.block_until_ready(out)
        state[0], state[1] = out[0], out[1]
        loops.append([f, state, []])
    for _ in range(reps):
        for loop in loops:
            f, state, times = loop
            t = time.perf_counter()
            out = f(*state)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t)
            state[0], state[1] = out[0], out[1]
    return tuple(statistics.median(times) for _, _, times in loops)


def main_mixed(layers):
    mb = 1e-6
    print("examples/gpt_plan.py GPT under FSDP, mesh 8, MB per device")
    print(f"{'dtype':9} {'layers':>6} {'args':>7} {'temp':>7} {'peak':>7} | gathers at start")
    for dtype in ("float32", "bfloat16"):
        for n in layers:
            r = measure_mixed(n, dtype)
            print(f"{dtype:9} {n:6d} {r['arguments'] * mb:7.2f} {r['temp'] * mb:7.2f} {r['peak'] * mb:7.2f} | "
                  f"{r['gathers_at_start']} of {r['gathers']}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 6, 12])
    ap.add_argument("--seq", type=int, default=32, help="sequence length (8: the weights outweigh the activations)")
    ap.add_argument("--mixed", action="store_true", help="examples/gpt_plan.py's GPT in float32 and bfloat16 instead")
    ap.add_argument("--time", type=int, default=0, metavar="REPS",
                    help="instead: median step times, FSDP against the same step without it, REPS turns")
    ap.add_argument("--plans", nargs="+", default=["fsdp", "tp+fsdp"], choices=["fsdp", "tp+fsdp"])
    a = ap.parse_args()
    if a.mixed:
        return main_mixed(a.layers)
    if a.time:
        print(f"median ms per step over {a.time} interleaved turns; plain: the same step without shard_params")
        for plan in a.plans:
            for n in a.layers:
                tf, tp = time_against_plain(n, plan, a.seq, a.time)
                print(f"{plan:8} {n:3d} layers: FSDP {tf * 1e3:8.2f}  plain {tp * 1e3:8.2f}  ratio {tf / tp:5.2f}",
                      flush=True)
        return
    mb = 1e-6
    print("MB per device; peak = arguments + outputs + temp - aliased; bound = arguments (state, stored split) "
          "+ two layers gathered + activations; over = peak - bound")
    print(f"{'plan':8} {'layers':>6} {'args':>7} {'out':>7} {'temp':>7} {'alias':>7} {'peak':>7} | "
          f"{'2 layers':>8} {'activ.':>7} {'bound':>7} {'over':>7} | {'modeled':>7} {'mod/peak':>8} | gathers at start")
    for plan in a.plans:
        for n in a.layers:
            r = measure(n, plan, a.seq)
            print(f"{plan:8} {n:6d} {r['arguments'] * mb:7.2f} {r['outputs'] * mb:7.2f} {r['temp'] * mb:7.2f} "
                  f"{r['aliased'] * mb:7.2f} {r['peak'] * mb:7.2f} | {r['two_layers'] * mb:8.2f} "
                  f"{r['activations'] * mb:7.2f} {r['bound'] * mb:7.2f} {(r['peak'] - r['bound']) * mb:7.2f} | "
                  f"{r['modeled'] * mb:7.2f} {r['modeled'] / r['peak']:8.2f} | {r['gathers_at_start']} of {r['gathers']}",
                  flush=True)


if __name__ == "__main__":
    main()
