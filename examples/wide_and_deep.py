"""Wide & deep CTR model on a synthetic Criteo-layout click log, in plain JAX.

13 dense features and 26 categorical ones, as in Criteo. The 26 features' embedding
rows live in one table (each feature owns a contiguous block of rows, so an id in the
batch is already a row of the table); the wide part is a second, one-column table over
the same rows. With the default sizes the tables hold 1,040,000 rows: large enough that
replicating them is the wrong plan.

The click log is deterministic and synthetic: categorical ids follow a Zipf law (a few
ids are hot, most are rare, as in real logs), and a hidden logistic model of the
features decides each click, so AUC says how much of that model was learned.

    python examples/wide_and_deep.py                     # one device, default sizes
    python examples/wide_and_deep.py --mode sync         # tables split by rows over 8 devices
    python examples/wide_and_deep.py --mode geo --k-steps 10
    python examples/wide_and_deep.py --compare-geo 10,100 --steps 600   # AUC and bytes side by side
    python examples/wide_and_deep.py --small --steps 50  # a quick run

Everything a benchmark or test needs is importable: ``Config``, ``ClickLog``,
``Batches`` (a parameter-server worker's reader), ``init_params``, ``logits``,
``loss_fn``, ``make_train_step``, ``auc``, ``train``.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

if __name__ == "__main__" and "--gpu" not in sys.argv:
    import shardprop as sp
    sp.use_cpu_devices(8)   # any machine can run it

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from scipy.stats import rankdata  # noqa: E402

NUM_DENSE = 13
NUM_SPARSE = 26


@dataclass(frozen=True)
class Config:
    vocab_sizes: tuple = (40_000,) * NUM_SPARSE   # rows per categorical feature (1,040,000 in all)
    embed_dim: int = 8
    hidden: tuple = (64, 32)
    zipf_exponent: float = 1.1                    # P(rank r) ~ r ** -zipf_exponent
    seed: int = 0

    @property
    def rows(self) -> int:
        return int(sum(self.vocab_sizes))

    @property
    def row_offsets(self) -> np.ndarray:
        """First table row of each categorical feature."""
        return np.concatenate([[0], np.cumsum(self.vocab_sizes)[:-1]]).astype(np.int64)

    @classmethod
    def small(cls, vocab: int = 96, **kw) -> "Config":
        """A small model for tests (26 * vocab rows)."""
        return cls(vocab_sizes=(vocab,) * NUM_SPARSE, **kw)


# -- the synthetic click log ------------------------------------------------------------

@dataclass
class ClickLog:
    """A deterministic click log: ``batch(i, n)`` is always the same n samples.

    Ids: per feature a Zipf law over its rows, whose ranks are scattered over the rows
    by a fixed permutation (hot ids are not all at the start of the table, so no shard
    of a row-split table holds all of them). Clicks: Bernoulli(sigmoid(hidden logit)),
    the hidden logit a bias, a linear function of the dense features, one hidden weight
    per categorical row and a small interaction of two dense features.
    """
    config: Config
    _cdfs: list = field(init=False, repr=False)
    _perms: list = field(init=False, repr=False)

    def __post_init__(self):
        cfg = self.config
        rng = np.random.default_rng((cfg.seed, 7))
        self._cdfs, self._perms = [], []
        for n in cfg.vocab_sizes:
            p = np.arange(1, n + 1, dtype=np.float64) ** -cfg.zipf_exponent
            self._cdfs.append(np.cumsum(p) / p.sum())
            self._perms.append(rng.permutation(n))
        self.true_bias = -1.2
        self.true_dense = rng.normal(0.0, 0.4, NUM_DENSE)
        self.true_rows = rng.normal(0.0, 0.5, cfg.rows)

    def batch(self, index: int, size: int, split: str = "train") -> dict:
        """Samples [index * size, (index + 1) * size) of the train (or eval) stream:
        ``dense`` float32 [size, 13], ``ids`` int32 [size, 26] (rows of the table),
        ``label`` float32 [size] (1 = click)."""
        cfg = self.config
        rng = np.random.default_rng((cfg.seed, {"train": 0, "eval": 1}[split], index, size))
        dense = rng.standard_normal((size, NUM_DENSE))
        u = rng.random((size, NUM_SPARSE))
        ids = np.empty((size, NUM_SPARSE), np.int64)
        for f in range(NUM_SPARSE):
            rank = np.minimum(np.searchsorted(self._cdfs[f], u[:, f]), cfg.vocab_sizes[f] - 1)
            ids[:, f] = cfg.row_offsets[f] + self._perms[f][rank]
        logit = (self.true_bias + dense @ self.true_dense + self.true_rows[ids].sum(1)
                 + 0.5 * np.tanh(dense[:, 0] * dense[:, 1]))
        label = rng.random(size) < 1.0 / (1.0 + np.exp(-logit))
        return {"dense": dense.astype(np.float32), "ids": ids.astype(np.int32), "label": label.astype(np.float32)}


class Batches:
    """A parameter-server job's reader (``sp.ps.Job(batches=...)``): worker w of n reads
    global batches w, w + n, w + 2n, ... of the click log, ``size`` samples each.
    Ray pickles it by reference, so it lives here, in the module that Ray's worker
    processes import anyway for ``loss_fn``."""

    def __init__(self, cfg: Config, size: int):
        self.log, self.size = ClickLog(cfg), size

    def __call__(self, worker: int, num_workers: int):
        i = worker
        while True:
            yield self.log.batch(i, self.size)
            i += num_workers


# -- the model --------------------------------------------------------------------------

def init_params(cfg: Config, seed: int = 0) -> dict:
    """``emb`` [rows, embed_dim] and ``wide`` [rows, 1] are the sparse tables; the rest is dense."""
    rng = np.random.default_rng(seed)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    sizes = (NUM_DENSE + NUM_SPARSE * cfg.embed_dim,) + tuple(cfg.hidden) + (1,)
    mlp = [(f32(rng.standard_normal((a, b)) / np.sqrt(a)), f32(np.zeros(b))) for a, b in zip(sizes[:-1], sizes[1:])]
    return {"emb": f32(rng.normal(0.0, 0.01, (cfg.rows, cfg.embed_dim))),
            "wide": f32(np.zeros((cfg.rows, 1))),
            "dense_w": f32(np.zeros(NUM_DENSE)),
            "bias": f32(0.0),
            "mlp": mlp}


def lookup(table, ids):
    """Rows of an embedding table: [rows, d] looked up by ids [...] gives [..., d]."""
    return table[ids]


def logits(params: dict, dense, ids):
    """Wide (linear in the dense features and one weight per id) plus deep (an MLP over
    the dense features and the 26 embeddings)."""
    wide = lookup(params["wide"], ids)[..., 0].sum(-1) + dense @ params["dense_w"] + params["bias"]
    emb = lookup(params["emb"], ids)
    h = jnp.concatenate([dense, emb.reshape(emb.shape[0], -1)], axis=-1)
    for w, b in params["mlp"][:-1]:
        h = jax.nn.relu(h @ w + b)
    w, b = params["mlp"][-1]
    return wide + (h @ w + b)[:, 0]


def loss_fn(params: dict, batch: dict):
    return optax.sigmoid_binary_cross_entropy(logits(params, batch["dense"], batch["ids"]), batch["label"]).mean()


def make_optimizer(learning_rate: float = 0.5):
    """Plain SGD: its update is linear in the gradient, so averaging replicas' one-step
    deltas is the synchronous step (GEO with k_steps=1 equals sync)."""
    return optax.sgd(learning_rate)


def make_train_step(optimizer):
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return train_step


def auc(labels, scores) -> float:
    """Area under the ROC curve by ranks (Mann-Whitney U), ties counted half."""
    labels = np.asarray(labels) > 0.5
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        raise ValueError("AUC needs both clicks and non-clicks in the labels")
    ranks = rankdata(np.asarray(scores, np.float64))
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def evaluate(params: dict, log: ClickLog, samples: int = 16384) -> tuple:
    """(log loss, AUC) on a held-out slice of the log."""
    batch = log.batch(0, samples, split="eval")
    z = np.asarray(jax.jit(logits)(params, batch["dense"], batch["ids"]))
    loss = float(optax.sigmoid_binary_cross_entropy(z, batch["label"]).mean())
    return loss, auc(batch["label"], z)


# -- training: one device, sync or GEO ------------------------------------------------

TABLES = {"emb": "ids", "wide": "ids"}   # each table and the batch field of its ids


def stacked(log: ClickLog, first: int, k: int, batch: int) -> dict:
    """Batches first .. first + k - 1 of the log, stacked: every leaf [k, batch, ...]."""
    return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *[log.batch(first + j, batch) for j in range(k)])


def train(cfg: Config, mode: str = "single", *, k_steps: int = 1, steps: int = 300, batch: int = 1024,
          lr: float = 0.5, devices: int = 8, print_every: int = 0, eval_samples: int = 16384) -> dict:
    """Train ``steps`` global batches (the same samples in every mode) and evaluate.

    mode "single": ``jax.jit`` on one device; "sync": ``sp.ps.sync``, the tables split by
    rows over ``devices``; "geo": ``sp.ps.geo`` with ``k_steps`` local steps per replica
    between averagings (``steps`` must be a multiple of it). Returns the eval AUC and
    log loss, the last train loss, the plan's bytes sent per device per sample
    (0 on one device) and the seconds spent training."""
    import time
    import shardprop as sp
    log = ClickLog(cfg)
    params = init_params(cfg)
    optimizer = make_optimizer(lr)
    opt_state = optimizer.init(params)
    step = make_train_step(optimizer)
    per_call = k_steps if mode == "geo" else 1
    if steps % per_call:
        raise ValueError(f"steps={steps} is not a multiple of k_steps={k_steps}")
    if mode == "single":
        run, bytes_per_sample = jax.jit(step), 0.0
    elif mode == "sync":
        run = sp.ps.sync(step, mesh=devices, tables=tuple(TABLES))
        bytes_per_sample = run.plan(params, opt_state, log.batch(0, batch)).bytes / batch
    elif mode == "geo":
        run = sp.ps.geo(step, k_steps=k_steps, mesh=devices, tables=TABLES)
        state = run.init(params, opt_state)
        bytes_per_sample = run.bytes_per_sample(state, stacked(log, 0, k_steps, batch))
    else:
        raise ValueError(f"mode={mode!r}: 'single', 'sync' or 'geo'")
    start = time.perf_counter()
    for call in range(steps // per_call):
        if mode == "geo":
            state, losses = run(state, stacked(log, call * k_steps, k_steps, batch))
            loss, params = losses[-1], state.params
        else:
            params, opt_state, loss = run(params, opt_state, log.batch(call, batch))
        done = (call + 1) * per_call
        if print_every and (done % print_every < per_call or done == steps):
            eval_loss, eval_auc = evaluate(params, log, eval_samples)
            name = f"geo k={k_steps}" if mode == "geo" else mode
            print(f"{name} step {done}: train loss {float(loss):.4f}  "
                  f"eval loss {eval_loss:.4f}  AUC {eval_auc:.4f}", flush=True)
    seconds = time.perf_counter() - start
    eval_loss, eval_auc = evaluate(params, log, eval_samples)
    return {"mode": mode, "k_steps": k_steps if mode == "geo" else None, "auc": eval_auc, "eval_loss": eval_loss,
            "train_loss": float(loss), "bytes_per_sample": bytes_per_sample, "seconds": seconds,
            "samples": steps * batch}


# -- the script -------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("single", "sync", "geo"), default="single")
    ap.add_argument("--k-steps", type=int, default=10, help="GEO: local steps between averagings")
    ap.add_argument("--compare-geo", metavar="K,K,...",
                    help="train sync and GEO with each k on the same samples and print AUC and bytes per sample")
    ap.add_argument("--small", action="store_true", help="26 x 96 rows instead of 26 x 40,000")
    ap.add_argument("--steps", type=int, default=300, help="global batches to train on")
    ap.add_argument("--batch", type=int, default=1024, help="global batch size")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--print-every", type=int, default=50)
    ap.add_argument("--gpu", action="store_true", help="use the machine's accelerators instead of 8 CPU devices")
    args = ap.parse_args(argv)
    cfg = Config.small() if args.small else Config()
    devices = len(jax.devices()) if args.gpu else 8
    print(f"wide&deep: {cfg.rows:,} table rows, embed_dim {cfg.embed_dim}, global batch {args.batch}, "
          f"{args.steps} steps ({args.steps * args.batch:,} samples)", flush=True)
    if args.compare_geo:
        runs = [train(cfg, "sync", steps=args.steps, batch=args.batch, lr=args.lr, devices=devices)]
        for k in (int(k) for k in args.compare_geo.split(",")):
            runs.append(train(cfg, "geo", k_steps=k, steps=args.steps, batch=args.batch, lr=args.lr,
                              devices=devices))
        sync_auc = runs[0]["auc"]
        print(f"{'mode':<8} {'AUC':>7} {'vs sync':>8} {'eval loss':>9} {'bytes/sample':>13} {'wall s':>8}")
        for r in runs:
            name = "sync" if r["mode"] == "sync" else f"geo k={r['k_steps']}"
            print(f"{name:<8} {r['auc']:7.4f} {100 * (r['auc'] / sync_auc - 1):+7.2f}% {r['eval_loss']:9.4f} "
                  f"{r['bytes_per_sample']:13,.0f} {r['seconds']:8.1f}")
        return runs
    return train(cfg, args.mode, k_steps=args.k_steps, steps=args.steps, batch=args.batch, lr=args.lr,
                 devices=devices, print_every=args.print_every)


if __name__ == "__main__":
    main()
