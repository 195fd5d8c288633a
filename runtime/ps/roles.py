"""One script, every role. ``shardprop launch --server-num N --worker-num M`` starts
N server processes and M worker processes of the same script; the environment
tells each its role and index."""
from __future__ import annotations

import os

ENV_ROLE = "SHARDPROP_PS_ROLE"        # "server" or "worker"
ENV_INDEX = "SHARDPROP_PS_INDEX"
ENV_SERVERS = "SHARDPROP_PS_SERVERS"
ENV_WORKERS = "SHARDPROP_PS_WORKERS"
ENV_MODE = "SHARDPROP_PS_MODE"
ENV_RAY_ADDRESS = "SHARDPROP_PS_RAY_ADDRESS"


def role() -> str | None:
    """'server', 'worker', or None outside ``shardprop launch --server-num/--worker-num``."""
    return os.environ.get(ENV_ROLE)


def is_server() -> bool:
    return role() == "server"


def is_worker() -> bool:
    return role() == "worker"


def role_index() -> int:
    return int(os.environ.get(ENV_INDEX, "0"))
