"""Parameter-server training of wide&deep (examples/wide_and_deep.py): samples/s and
bytes per sample for sync, GEO (k = 1, 10, 100) and async at 2 and 4 workers; one
worker made 3x slower against none, async and sync side by side in one run (sync at
the learning rate times the worker count, see part_slow); and the table size at which
splitting the tables by rows beats replicating them.

    python bench/ps.py                    # every part
    python bench/ps.py --part slow        # one part: modes | slow | crossover
    python bench/ps.py --small            # 26 x 96 rows instead of 26 x 40,000 (quick)

sync and GEO are SPMD programs (sp.ps.sync, sp.ps.geo) over 2 or 4 of 8 forced CPU
devices, one replica per device; their bytes are what the plan's collectives send per
device, divided by the samples of a step (a GEO round: k steps). async and GEO-async
run on Ray (sp.ps.Job, 2 servers): the bytes of every pull and push, divided by the
samples trained. Figures are medians of --reps repetitions; the machine's cores are
shared by every process (Ray's actors included), so compare within one run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import shardprop as sp  # noqa: E402

sp.use_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import wide_and_deep as wd  # noqa: E402

TABLES = {"emb": "ids", "wide": "ids"}
LR = 0.5


def stacked(log, first, count, size):
    """``count`` consecutive global batches stacked on a leading axis (a GEO round's input)."""
    bs = [log.batch(first + i, size) for i in range(count)]
    return {k: np.stack([b[k] for b in bs]) for k in bs[0]}


def fmt_rate(x):
    return f"{x:,.0f}"


def samples_per_s(step, params, state, log, size, reps):
    """Median samples/s of ``step(params, state, batch)`` over ``reps`` fresh batches, after
    one step that compiles."""
    params, state, loss = step(params, state, log.batch(0, size))   # compile
    jax.block_until_ready(loss)
    times = []
    for r in range(reps):
        b = log.batch(1 + r, size)
        t = time.perf_counter()
        params, state, loss = step(params, state, b)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t)
    return size / statistics.median(times)


# -- sync and GEO (SPMD) ----------------------------------------------------------------

def bench_sync(cfg, log, devices, per_worker, reps):
    opt = wd.make_optimizer(LR)
    step = sp.ps.sync(wd.make_train_step(opt), mesh=devices, tables=tuple(TABLES))
    size = per_worker * devices
    params = wd.init_params(cfg)
    state = opt.init(params)
    batch = log.batch(0, size)
    plan = step.plan(params, state, batch)
    moved = sum(c.bytes for c in plan.collectives)
    return samples_per_s(step, params, state, log, size, reps), moved / size


def bench_geo(cfg, log, devices, per_worker, k, reps):
    opt = wd.make_optimizer(LR)
    geo = sp.ps.geo(wd.make_train_step(opt), k_steps=k, mesh=devices, tables=TABLES)
    size = per_worker * devices
    params = wd.init_params(cfg)
    state = geo.init(params, opt.init(params))
    rounds = max(1, min(reps, 400 // k))
    batches = [stacked(log, i * k, k, size) for i in range(rounds + 1)]
    per_sample = geo.bytes_per_sample(state, batches[0])
    state, losses = geo(state, batches[0])   # compile
    jax.block_until_ready(losses)
    times = []
    for b in batches[1:]:
        t = time.perf_counter()
        state, losses = geo(state, b)
        jax.block_until_ready(losses)
        times.append(time.perf_counter() - t)
    return k * size / statistics.median(times), per_sample


# -- async (Ray) ------------------------------------------------------------------------

def make_job(cfg, workers, per_worker, servers=2, k_steps=None):
    return sp.ps.Job(wd.loss_fn, wd.init_params(cfg), TABLES, wd.Batches(cfg, per_worker), wd.make_optimizer(LR),
                     num_servers=servers, num_workers=workers, mode="geo" if k_steps else "async",
                     max_staleness=16, k_steps=k_steps)


def bench_async(cfg, workers, per_worker, budget, reps, k_steps=None):
    with make_job(cfg, workers, per_worker, k_steps=k_steps) as job:
        job.train(per_worker * workers * max(8, k_steps or 0))   # compile the bucket sizes
        rates, per_sample = [], []
        for _ in range(reps):
            job.reset()
            r = job.train(budget)
            rates.append(r.samples / r.seconds)
            per_sample.append(r.bytes_per_sample())
    return statistics.median(rates), statistics.median(per_sample)


def part_modes(cfg, args):
    log = wd.ClickLog(cfg)
    print(f"\n## samples/s and bytes per sample ({cfg.rows:,} table rows, {args.per_worker} samples per worker "
          f"per step)")
    print(f"{'mode':<14}{'workers':>8}{'samples/s':>12}{'bytes/sample':>14}")
    rows = []
    for n in (2, 4):
        rows.append(("sync", n) + bench_sync(cfg, log, n, args.per_worker, args.reps))
        print(f"{'sync':<14}{n:>8}{fmt_rate(rows[-1][2]):>12}{rows[-1][3]:>14,.1f}", flush=True)
        for k in (1, 10, 100):
            rows.append((f"GEO k={k}", n) + bench_geo(cfg, log, n, args.per_worker, k, args.reps))
            print(f"{rows[-1][0]:<14}{n:>8}{fmt_rate(rows[-1][2]):>12}{rows[-1][3]:>14,.1f}", flush=True)
        rows.append(("async (Ray)", n) + bench_async(cfg, n, args.per_worker, args.budget, args.reps))
        print(f"{'async (Ray)':<14}{n:>8}{fmt_rate(rows[-1][2]):>12}{rows[-1][3]:>14,.1f}", flush=True)
        for k in (10, 100):
            rows.append((f"GEO-async k={k}", n) + bench_async(cfg, n, args.per_worker, args.budget, args.reps, k))
            print(f"{rows[-1][0]:<16}{n:>6}{fmt_rate(rows[-1][2]):>12}{rows[-1][3]:>14,.1f}", flush=True)
    return rows


# -- a slow worker, async against sync ----------------------------------------------------

def part_slow(cfg, args):
    """4 workers, worker 1 made 3x slower (each of its steps sleeps twice its own
    duration), against all at the same pace; async and sync on the same actors.
    Sync averages the 4 gradients of a step into one update (Paddle's merge), so at
    the same samples it makes a quarter of async's updates: it runs at the learning
    rate times 4 (the linear scaling rule for a 4x larger batch); one more sync run
    at the unscaled rate shows what the scaling is worth."""
    log = wd.ClickLog(cfg)
    workers = 4
    print(f"\n## one worker 3x slower ({workers} workers, 2 servers, {args.per_worker} samples per step, budget "
          f"{args.budget:,} samples, median of {args.reps})")
    cases = [("async", {}, LR), ("async", {1: 3.0}, LR), ("sync", {}, LR * workers), ("sync", {1: 3.0}, LR * workers),
             ("sync", {}, LR)]
    runs = {}
    with make_job(cfg, workers, args.per_worker) as job:
        job.train(args.per_worker * workers * 8)
        for _ in range(args.reps):      # interleaved, so drift in the machine's load hits every case alike
            for mode, slow, lr in cases:
                job.reset(mode, slow, wd.make_optimizer(lr))
                r = job.train(args.budget)
                fast = statistics.median(w["samples_per_s"] for w in r.workers if w["worker"] != 1)
                slowest = [w["samples_per_s"] for w in r.workers if w["worker"] == 1]
                runs.setdefault((mode, bool(slow), lr), []).append(
                    (fast, slowest[0] if slowest else 0.0, wd.evaluate(job.params(), log)[1], r.staleness["max"]))
    med = {k: tuple(statistics.median(x[i] for x in v) for i in range(4)) for k, v in runs.items()}
    print(f"{'mode':<7}{'lr':>6}{'worker 1':>10}{'others samples/s':>18}{'worker 1 samples/s':>20}{'AUC':>8}"
          f"{'max stale':>11}")
    for (mode, slow, lr), (fast, one, auc, stale) in med.items():
        print(f"{mode:<7}{lr:>6.2f}{'3x slow' if slow else 'even':>10}{fmt_rate(fast):>18}{fmt_rate(one):>20}"
              f"{auc:>8.4f}{stale:>11.0f}")
    sync_lr = LR * workers
    for mode, lr in (("async", LR), ("sync", sync_lr)):
        ratio = med[(mode, True, lr)][0] / med[(mode, False, lr)][0]
        print(f"{mode}: the other workers' throughput with a 3x slower worker is {ratio:.2f}x of all-even "
              f"({(1 - ratio) * 100:+.0f}% drop)")
    s = med[("sync", False, sync_lr)][2]
    for slow in (False, True):
        a = med[("async", slow, LR)][2]
        print(f"AUC after {args.budget:,} samples: async{' with the slow worker' if slow else ''} {a:.4f}, "
              f"sync at lr x{workers} {s:.4f} ({(a - s) / s * 100:+.1f}%)")
    return med


# -- row-split against replicated tables ---------------------------------------------------

def bench_replicated(cfg, log, devices, per_worker, reps):
    """Plain data parallel: every device holds the whole tables; their gradients are all-reduced."""
    opt = wd.make_optimizer(LR)
    params = wd.init_params(cfg)
    state = opt.init(params)
    size = per_worker * devices
    batch = log.batch(0, size)
    repl = jax.tree_util.tree_map(lambda x: (1,) * np.ndim(x), params)
    split = jax.tree_util.tree_map(lambda x: (devices,) + (1,) * (np.ndim(x) - 1), batch)
    step = sp.parallelize(wd.make_train_step(opt), mesh=devices, in_strategy=(repl, None, split),
                          donate_argnums=(0, 1))
    moved = sum(c.bytes for c in step.plan(params, state, batch).collectives)
    return samples_per_s(step, params, state, log, size, reps), moved / size


def part_crossover(cfg, args):
    devices = 4
    print(f"\n## row-split against replicated tables (sync, {devices} devices, {args.per_worker} samples per "
          f"device per step)")
    print(f"{'table rows':>12}{'row-split samples/s':>21}{'replicated samples/s':>22}{'row-split B/sample':>20}"
          f"{'replicated B/sample':>21}")
    first = None
    for vocab in args.vocabs:
        c = wd.Config(vocab_sizes=(vocab,) * wd.NUM_SPARSE)
        log = wd.ClickLog(c)
        split_rate, split_bytes = bench_sync(c, log, devices, args.per_worker, args.reps)
        repl_rate, repl_bytes = bench_replicated(c, log, devices, args.per_worker, args.reps)
        print(f"{c.rows:>12,}{fmt_rate(split_rate):>21}{fmt_rate(repl_rate):>22}{split_bytes:>20,.0f}"
              f"{repl_bytes:>21,.0f}", flush=True)
        if first is None and split_rate > repl_rate:
            first = c.rows
    print(f"row-split is faster from {first:,} table rows on" if first else
          "row-split was not faster at any size measured")
    return first


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "modes", "slow", "crossover"), default="all")
    ap.add_argument("--small", action="store_true", help="26 x 96 rows instead of 26 x 40,000")
    ap.add_argument("--per-worker", type=int, default=1024, help="samples per worker (device) per step")
    ap.add_argument("--budget", type=int, default=200_000, help="async/slow: samples per training run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--vocabs", type=int, nargs="+", default=[1_000, 4_000, 16_000, 40_000, 100_000],
                    help="crossover: rows per categorical feature")
    args = ap.parse_args(argv)
    cfg = wd.Config.small() if args.small else wd.Config()
    print(f"bench/ps.py: {os.cpu_count()} CPU cores, jax {jax.__version__}, {len(jax.devices())} devices")
    if args.part in ("all", "modes"):
        part_modes(cfg, args)
    if args.part in ("all", "slow"):
        part_slow(cfg, args)
    if args.part in ("all", "crossover"):
        part_crossover(cfg, args)


if __name__ == "__main__":
    main()
