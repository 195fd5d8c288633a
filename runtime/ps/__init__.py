"""Parameter-server training on Ray (the ``ps`` extra: ``pip install -e '.[ps]'``).

Server actors hold row ranges of the embedding tables and a share of the dense
parameters and apply what workers push as it arrives (optax on the server);
worker actors run the jitted gradient step on the rows they pulled. Nothing here
imports ray until a job starts, so ``import shardprop`` stays light.

    layout.py      which server holds which rows and which dense leaves (numpy only)
    staleness.py   the version gap of each push, the bound, the report
    rows.py        a batch's unique ids, remapped to a small local table
    sparse_update.py  optax on the rows of a table a push touched
    server.py      the server actor
    worker.py      the worker actor (pull, gradient, push)
    job.py         the driver: starts the actors, runs async or sync, watches for failures
    roles.py       one script, every role: what ``shardprop launch --server-num`` starts
    ray_env.py     the optional import and a local Ray cluster that leaves nothing behind
"""
from .ray_env import ParameterServerError, require_ray  # noqa: F401
