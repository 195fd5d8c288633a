"""Wide & deep trained asynchronously on parameter servers (Ray, ``pip install -e '.[ps]'``),
the way Fleet users launch it: one script serves every role.

    shardprop launch --server-num 1 --worker-num 2 examples/ps_async.py --small
    shardprop launch --server-num 1 --worker-num 2 examples/ps_async.py --small --k-steps 10   # GEO
    python examples/ps_async.py --small          # the same job, local: 1 server and 2 worker actors

Servers hold row ranges of the embedding tables (and the dense layers) and apply each
worker's gradient as it arrives; workers pull the rows their batch needs, run the jitted
gradient of ``wide_and_deep.loss_fn`` and push row gradients. Nobody waits for a slow
worker; a push more than ``--max-staleness`` updates old is refused and its worker pulls
fresh parameters.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import optax  # noqa: E402
import wide_and_deep as wd  # noqa: E402

import shardprop as sp  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="26 x 96 rows instead of 26 x 40,000")
    ap.add_argument("--samples", type=int, default=200_000, help="sample budget over all workers")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--max-staleness", type=int, default=16)
    ap.add_argument("--k-steps", type=int, default=None, help="GEO: local steps between a worker's pushes")
    ap.add_argument("--servers", type=int, default=1, help="without the launcher: server actors")
    ap.add_argument("--workers", type=int, default=2, help="without the launcher: worker actors")
    args = ap.parse_args(argv)
    cfg = wd.Config.small() if args.small else wd.Config()
    out = sp.ps.run(wd.loss_fn, wd.init_params(cfg), {"emb": "ids", "wide": "ids"}, wd.Batches(cfg, args.batch),
                    optax.sgd(args.lr), samples=args.samples, num_servers=args.servers, num_workers=args.workers,
                    max_staleness=args.max_staleness, k_steps=args.k_steps)
    if out.role == "driver":
        r = out.report
        for w in sorted(r.workers, key=lambda w: w["worker"]):
            print(f"worker {w['worker']}: {w['samples']} samples, {w['samples_per_s']:.0f} samples/s")
        print(f"staleness: max {r.staleness['max']}, mean {r.staleness['mean']:.2f}, refused {r.staleness['refused']}")
    if out.role in ("driver", "worker") and out.index == 0:
        loss, auc = wd.evaluate(out.params(), wd.ClickLog(cfg))
        print(f"eval loss {loss:.4f}  AUC {auc:.4f}")


if __name__ == "__main__":
    main()
