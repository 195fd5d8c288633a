"""Differential fuzzing of pipelines: random models, cuts and pipeline configurations,
each trained two steps by ``sp.parallelize(..., pipeline=sp.Pipeline(...))`` and by
``jax.jit`` on one device, and compared (losses, parameters, optimizer state; a
forward's outputs).

    python -m tests.fuzz.pipeline --n 200 --seed 7        # the run: one line per draw, then counts
    python -m tests.fuzz.pipeline --seed 7 --index 12     # one draw: its configuration and outcome

The op fuzzer (``python -m tests.fuzz``) draws op graphs on one mesh; this one draws what
a pipeline adds: a chain of blocks of different kinds and widths of work, cuts by
``stage_boundary`` marks, none (the compiler's cuts) or layers per stage, a tied weight read by the first
and the last stage, a scalar parameter every stage may read, ``pp`` alone or beside
``dp`` and ``mp`` (with Megatron column marks), the schedule, the number of
micro-batches (or both searched), the lowering, ZeRO-1, the optimizer, ``mode="auto"`` on
the axes beside ``pp``. A draw is one of: ``right`` (equal
to one device), ``rejected`` (a ``ShardingError``; counted, with its first line),
``wrong`` (a result differs) or ``crash`` (any other exception): the last two are bugs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

BLOCKS = ("dense", "residual", "norm", "gated", "softmax", "reshape")
SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "interleaved")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
RTOL, ATOL = 1e-4, 2e-5   # relative, and absolute per unit of the largest magnitude
LR = 1e-2                 # Adam's learning rate


@dataclass
class Draw:
    """One pipeline configuration, all of it from (seed, index)."""
    index: int
    width: int
    blocks: list
    tied: bool
    scalar: bool
    mesh: tuple                 # ((sizes), (names))
    schedule: str
    virtual: int
    microbatches: int
    rows: int                   # rows per micro-batch per data-parallel device
    marks: bool                 # stage_boundary marks (else the compiler cuts)
    column_marks: bool          # Megatron column marks over mp on the dense blocks
    lowering: str
    zero1: bool
    optimizer: str
    forward_only: bool
    cuts: list = field(default_factory=list)
    search: str = ""            # "", "schedule" (microbatches and schedule "auto") or "mode" (mode="auto")
    layers: tuple = ()          # sp.Pipeline(stages=...): layers per model stage (the blocks all alike)

    @property
    def pp(self) -> int:
        return self.mesh[0][self.mesh[1].index("pp")]

    def axis(self, name) -> int:
        return self.mesh[0][self.mesh[1].index(name)] if name in self.mesh[1] else 1

    @property
    def batch(self) -> int:
        return self.microbatches * self.axis("dp") * self.rows

    def __str__(self):
        mesh = " x ".join(f"{n}={s}" for s, n in zip(*self.mesh))
        return (f"#{self.index}: {mesh}, {self.schedule}" + (f" v={self.virtual}" if self.virtual > 1 else "") +
                f", m={self.microbatches}, batch {self.batch}, {self.lowering}, width {self.width}, blocks "
                f"{','.join(self.blocks)}" + (f", cuts after {self.cuts}" if self.marks else ", compiler's cuts") +
                (", tied" if self.tied else "") + (", scalar" if self.scalar else "") +
                (f", layers per stage {self.layers}" if self.layers else "") +
                (", column marks" if self.column_marks else "") + (", ZeRO-1" if self.zero1 else "") +
                {"": "", "schedule": ", microbatches and schedule searched", "mode": ", mode=auto"}[self.search] +
                f", {'forward only' if self.forward_only else self.optimizer}")


def draw(seed: int, index: int) -> Draw:
    import numpy as np
    rng = np.random.default_rng([seed, index])
    pick = lambda xs: xs[int(rng.integers(len(xs)))]   # noqa: E731
    pp = pick([2, 2, 4, 4, 8])
    others = [a for a in (("dp", 2), ("mp", 2)) if rng.random() < 0.4 and pp * 2 <= 8]
    if len(others) == 2 and pp * 4 > 8:
        others = others[:1]
    mesh = ((pp,) + tuple(s for _, s in others), ("pp",) + tuple(n for n, _ in others))
    schedule = pick(SCHEDULES)
    virtual = 2 if schedule == "interleaved" else 1
    stages = pp * virtual
    n_blocks = int(rng.integers(max(2, stages), max(2, stages) + 5))
    width = pick([4, 8, 12])
    blocks = [pick(BLOCKS) for _ in range(n_blocks)]
    cuts = sorted(rng.choice(n_blocks - 1, size=stages - 1, replace=False).tolist()) if stages > 1 else []
    d = Draw(index=index, width=width, blocks=blocks, tied=bool(rng.random() < 0.3), scalar=bool(rng.random() < 0.3),
             mesh=mesh, schedule=schedule, virtual=virtual,
             microbatches=pick([pp, 2 * pp] if schedule == "interleaved" else [1, 2, pp, 2 * pp]),
             rows=pick([2, 3]), marks=bool(rng.random() < 0.6), column_marks=False,
             lowering=pick(["spmd", "mpmd"]), zero1=False, optimizer=pick(OPTIMIZERS),
             forward_only=bool(rng.random() < 0.15), cuts=cuts)
    d.column_marks = "mp" in mesh[1] and rng.random() < 0.6
    d.zero1 = "dp" in mesh[1] and not d.forward_only and d.optimizer in ("adam", "adamw", "momentum") \
        and rng.random() < 0.4
    # (drawn last, so that the draws made before it was added stay as they were)
    roll = rng.random()
    d.search = "schedule" if roll < 0.15 and d.marks and virtual == 1 else \
        "mode" if roll > 0.85 else ""
    if rng.random() < 0.3 and not d.marks:   # (drawn after the search switch, likewise)
        d.blocks = [d.blocks[0]] * n_blocks
        edges = sorted(int(e) + 1 for e in rng.choice(n_blocks - 1, size=stages - 1, replace=False))
        d.layers = tuple(int(b - a) for a, b in zip([0] + edges, edges + [n_blocks]))
    return d


def build(d: Draw):
    """(step, args, batch_argnums, train): the step written for one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    import shardprop as sp
    rng = np.random.default_rng([d.index, 99])
    w = d.width

    def normal(*shape, scale=0.4):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    params = {"blocks": []}
    for kind in d.blocks:
        if kind in ("dense", "gated"):
            params["blocks"].append({"w": normal(w, w), "b": normal(w, scale=0.1)})
        elif kind == "residual":
            params["blocks"].append({"w1": normal(w, 2 * w), "w2": normal(2 * w, w)})
        elif kind == "norm":
            params["blocks"].append({"g": 1 + normal(w, scale=0.1)})
        else:
            params["blocks"].append({"w": normal(w, w)})
    params["embed"] = normal(w, w)
    if d.scalar:
        params["temperature"] = np.float32(1.3)
    column = sp.shard(jnp.matmul, (P(None, None), P(None, "mp"))) if d.column_marks else jnp.matmul

    def forward(params, x):
        h = x @ params["embed"]
        for i, (kind, p) in enumerate(zip(d.blocks, params["blocks"])):
            if kind == "dense":
                h = jnp.tanh(column(h, p["w"]) + p["b"])
            elif kind == "gated":
                h = h * jax.nn.sigmoid(h @ p["w"] + p["b"])
            elif kind == "residual":
                h = h + jax.nn.gelu(column(h, p["w1"])) @ p["w2"]
            elif kind == "norm":
                mu = h.mean(-1, keepdims=True)
                h = (h - mu) / jnp.sqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * p["g"]
            elif kind == "softmax":
                h = jax.nn.softmax(h @ p["w"], axis=-1) * w
            else:   # a reshape round trip around a matmul over halves of the features
                b = h.shape[0]
                h = jnp.tanh((h.reshape(b, 2, w // 2) @ p["w"][: w // 2, : w // 2]).reshape(b, w))
            if d.marks and i in d.cuts:
                h = sp.stage_boundary(h)
        if d.tied:
            h = h @ params["embed"].T
        if d.scalar:
            h = h / params["temperature"]
        return h

    x = normal(d.batch, w, scale=1.0)
    if d.forward_only:
        def infer(params, x):
            out = forward(params, x)
            return out, jnp.sum(out ** 2)
        return infer, (params, x), (1,), False
    y = normal(d.batch, w, scale=1.0)
    opt = {"sgd": optax.sgd(0.05), "momentum": optax.sgd(0.05, momentum=0.9), "adam": optax.adam(LR),
           "adamw": optax.adamw(LR, weight_decay=0.1)}[d.optimizer]

    def loss_fn(params, x, y):
        return jnp.mean((forward(params, x) - y) ** 2)

    def step(params, opt_state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        up, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, up), opt_state, loss
    return step, (params, opt.init(params), x, y), (2, 3), True


def _compare(got, want, what: str, slack: float = 0.0):
    """None where ``got`` equals ``want`` to rounding (and ``slack`` more, absolute), else
    what differs."""
    import jax
    import numpy as np

    import shardprop as sp
    gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(gl) != len(wl):
        return f"{what}: {len(gl)} leaves, one device gives {len(wl)}"
    for k, (g, w) in enumerate(zip(gl, wl)):
        g, w = np.asarray(sp.to_numpy(g), np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            return f"{what} leaf {k}: shape {g.shape}, one device gives {w.shape}"
        scale = max(1.0, float(np.abs(w).max(initial=0.0)))
        err = np.abs(g - w)
        if (err > RTOL * np.abs(w) + ATOL * scale + slack).any() or np.isfinite(g).all() != np.isfinite(w).all():
            return f"{what} leaf {k} {list(w.shape)}: max error {err.max():.3g} (scale {scale:.3g})"
    return None


def _adam_applied(before, after, opt_state, weight_decay: float, what: str):
    """None where the weights ``after`` are ``before`` moved by Adam's update of the moments
    in ``opt_state`` (optax's: the bias-corrected first moment over the root of the
    second's, plus the decay, times the learning rate), to rounding; else what differs."""
    import jax
    import numpy as np

    import shardprop as sp
    adam = next(s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu"))
    t = int(sp.to_numpy(adam.count))
    f64 = lambda x: np.asarray(sp.to_numpy(x), np.float64)   # noqa: E731

    def moved(p, m, v):
        p, m, v = f64(p), f64(m), f64(v)
        return p - LR * ((m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8) + weight_decay * p)
    expected = jax.tree.map(moved, before, adam.mu, adam.nu)
    return _compare(after, expected, f"{what}: the weights against Adam's update of the step's own moments")


def _refereed(step, args, steps: int, got, want, what: str, pick) -> tuple:
    """(outcome, detail) where ``got`` (the parallel run's) and ``want`` (one device's, in
    float32) differ beyond rounding: one device again in float64 referees. Over steps a
    difference compounds (Adam's step-1 rounding moves the weights step 2's gradients
    are taken at), so the parallel result is right where it is as close to the float64
    one as one device's float32 is (twice that, plus rounding), elementwise."""
    import jax
    import numpy as np

    import shardprop as sp

    def wide(x):
        x = np.asarray(x)
        return x.astype(np.float64) if x.dtype == np.float32 else x
    with jax.enable_x64(True):
        state, ref = jax.tree.map(wide, tuple(args)), jax.jit(step)
        for _ in range(steps):
            out = ref(*state)
            state = tuple(out[:-1]) + state[len(out) - 1:]
        truth = [np.asarray(x, np.float64) for x in jax.tree.leaves(pick(out))]
    worst = None
    for k, (g, w, t) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), truth)):
        g, w = np.asarray(sp.to_numpy(g), np.float64), np.asarray(w, np.float64)
        scale = max(1.0, float(np.abs(t).max(initial=0.0)))
        over = np.abs(g - t) - (2 * np.abs(w - t) + RTOL * np.abs(t) + ATOL * scale)
        if over.max(initial=-1.0) > 0:
            return "wrong", (f"{what} leaf {k}: {np.abs(g - t).max():.3g} from one device in float64, against "
                             f"{np.abs(w - t).max():.3g} for one device in float32")
        worst = max(worst or 0.0, float(np.abs(g - w).max(initial=0.0)))
    return "right", f"{what}: {worst:.3g} from one device in float32, within its own distance from float64"


def run(d: Draw, steps: int = 2) -> tuple:
    """(outcome, detail) of one draw."""
    import jax

    import shardprop as sp
    step, args, batch_argnums, train = build(d)
    try:
        searched = d.search == "schedule"
        pipe = sp.Pipeline(microbatches="auto" if searched else d.microbatches,
                           schedule="auto" if searched else d.schedule, virtual_stages=d.virtual,
                           lowering=d.lowering, stages=d.layers or None)
        kw = dict(shard_optimizer_state=True) if d.zero1 else {}
        if d.search == "mode":
            kw["mode"] = "auto"
        pstep = sp.parallelize(step, mesh=d.mesh, pipeline=pipe, batch_argnums=batch_argnums, **kw)
        ref = jax.jit(step)
        if not train:
            bad = _compare(pstep(*args), ref(*args), "output")
            return ("wrong", bad) if bad else ("right", "")
        adaptive = d.optimizer in ("adam", "adamw")
        got, want = args, args
        for n in range(steps):
            *gs, gl = pstep(*got)
            *ws, wl = ref(*want)
            bad = _adam_applied(got[0], gs[0], gs[1], 0.1 if d.optimizer == "adamw" else 0.0, f"step {n + 1}") \
                if adaptive else None
            if bad:
                return "wrong", bad
            if _compare(gl, wl, f"step {n + 1} loss"):
                return _refereed(step, args, n + 1, gl, wl, "loss", lambda out: out[-1])
            got, want = tuple(gs) + args[len(gs):], tuple(ws) + args[len(ws):]
        # Adam divides each gradient by its running size: where a gradient is nearly all
        # cancellation, its rounding moves a weight by up to a learning rate a step (issue
        # 26: "Adam weights to about one learning rate"). So under Adam the weights are held
        # to the update of the step's own moments (``_adam_applied``, above), and the
        # moments, the gradients' averages, to one device's.
        if (None if adaptive else _compare(got[0], want[0], "parameters")) or \
                _compare(got[1], want[1], "optimizer state"):
            keep = (1,) if adaptive else (0, 1)
            return _refereed(step, args, steps, [got[k] for k in keep], [want[k] for k in keep],
                             f"after {steps} steps, the state", lambda out: [out[k] for k in keep])
        return "right", ""
    except sp.ShardingError as e:
        return "rejected", str(e).splitlines()[0][:200]
    except Exception as e:   # noqa: BLE001 (a crash on a valid program is what this looks for)
        return "crash", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}\n" + \
            "".join(traceback.format_exc().splitlines(True)[-6:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz.pipeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--index", type=int, action="append", help="only these draws")
    a = ap.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    counts, bad, reasons = Counter(), [], Counter()
    t0 = time.perf_counter()
    for i in a.index or range(a.n):
        d = draw(a.seed, i)
        t = time.perf_counter()
        outcome, detail = run(d)
        counts[outcome] += 1
        print(f"{outcome:<8} {time.perf_counter() - t:5.1f} s  {d}" + (f"\n         {detail}" if detail else ""),
              flush=True)
        if outcome == "rejected":
            reasons[detail[:90]] += 1
        if outcome in ("wrong", "crash"):
            bad.append((d, outcome, detail))
    print(f"\n{sum(counts.values())} draws (seed {a.seed}) in {time.perf_counter() - t0:.0f} s: " +
          ", ".join(f"{counts[k]} {k}" for k in ("right", "rejected", "wrong", "crash")))
    for r, n in reasons.most_common():
        print(f"  rejected {n}x: {r}")
    for d, outcome, _ in bad:
        print(f"  {outcome}: python -m tests.fuzz.pipeline --seed {a.seed} --index {d.index}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
