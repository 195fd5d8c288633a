"""``sp.ps``: parameter-server training for sparse models.

Async (and sync-on-Ray) training runs on Ray, an optional extra
(``pip install -e '.[ps]'``); Ray is imported only when a job starts.

    job = sp.ps.Job(loss_fn, params, tables={"emb": "ids"}, batches=..., optimizer=optax.sgd(0.5),
                    num_servers=2, num_workers=4, mode="async", max_staleness=16)
    with job:
        result = job.train(samples=1_000_000)   # samples/s per worker, staleness, failures
        params = job.params()

Under ``shardprop launch --server-num N --worker-num M train.py`` every process runs
the same script; ``is_server()`` / ``is_worker()`` say which role it has, and
``run(...)`` runs that role's loop.
"""
from __future__ import annotations

# sync and GEO as single SPMD programs (no Ray): tables split by rows; GEO's replica axis
from .compiler.geo import GeoState, GeoStep, geo  # noqa: F401
from .compiler.ps_sync import SyncStep, pad_rows, sync  # noqa: F401
from .runtime.ps.ray_env import ParameterServerError, require_ray  # noqa: F401
from .runtime.ps.roles import RoleResult, is_server, is_worker, role, role_index, run  # noqa: F401

_LAZY = {"Job": "job", "TrainResult": "job"}


def __getattr__(name):
    # job.py pulls in optax and the actors' code; load it when first used
    if name in _LAZY:
        import importlib
        module = importlib.import_module(f"shardprop.runtime.ps.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'shardprop.ps' has no attribute {name!r}")
