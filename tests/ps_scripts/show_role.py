"""Prints the role the launcher gave this process (and joins jax.distributed, as a sync run does)."""
import jax

import shardprop as sp
from shardprop.runtime.distributed import initialize

initialize()
print(f"role={sp.ps.role()} server={sp.ps.is_server()} worker={sp.ps.is_worker()} index={sp.ps.role_index()} "
      f"processes={jax.process_count()}", flush=True)
