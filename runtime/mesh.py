"""Meshes: from what the user passes (a device count, a ``jax.sharding.Mesh``, or
``(shape, axis_names)``) to the compiler's ``ir.Mesh`` and back to a jax Mesh
over real devices (GPUs, or forced CPU devices in tests)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh as JaxMesh

from ..ir.errors import ShardingError
from ..ir.mesh import Mesh, prime_factors


@dataclass(frozen=True)
class MeshSpec:
    """The user's mesh, resolved to devices. ``named`` meshes keep their axes;
    a device count becomes prime sub-axes ``d0, d1, ...`` (major first) so that
    any split count that divides it can be laid out MindSpore style."""
    devices: tuple
    ir_mesh: Mesh
    named: bool
    axis_types: tuple = ()   # of the user's jax Mesh; () for meshes built here (all Auto)

    def jax_mesh(self, ir_mesh: Mesh | None = None, axis_types: tuple = ()) -> JaxMesh:
        """The mesh the program runs on: Auto axes, the program's shard_map decides."""
        m = ir_mesh or self.ir_mesh
        arr = np.empty(len(self.devices), dtype=object)
        arr[:] = list(self.devices)
        return JaxMesh(arr.reshape(m.axis_sizes), m.axis_names,
                       axis_types=axis_types or (AxisType.Auto,) * len(m.axis_names))

    def trace_mesh(self) -> JaxMesh:
        """The mesh set while tracing: the user's axis types, so code written for a mesh
        with Explicit axes (``jax.sharding.reshard``) traces as it would under jit."""
        return self.jax_mesh(axis_types=self.axis_types)


def _take_devices(n: int) -> tuple:
    devices = jax.devices()
    if n > len(devices):
        platform = devices[0].platform if devices else "cpu"
        hint = (" On CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N or call "
                "jax.config.update('jax_num_cpu_devices', N) before jax initialises." if platform == "cpu" else "")
        raise ShardingError(f"the mesh needs {n} devices but jax sees {len(devices)} ({platform}).{hint}")
    return tuple(devices[:n])


def resolve_mesh(mesh: Any) -> MeshSpec:
    if isinstance(mesh, JaxMesh):
        return MeshSpec(tuple(mesh.devices.flat), Mesh(tuple(mesh.axis_names), tuple(mesh.devices.shape)), True,
                        tuple(mesh.axis_types))
    if isinstance(mesh, (int, np.integer)) and not isinstance(mesh, bool):
        n = int(mesh)
        if n < 1:
            raise ShardingError(f"mesh={mesh}: a device count must be at least 1")
        primes = prime_factors(n) or [1]
        names = tuple(f"d{i}" for i in range(len(primes)))
        return MeshSpec(_take_devices(n), Mesh(names, tuple(primes)), False)
    if isinstance(mesh, (tuple, list)) and len(mesh) == 2 and isinstance(mesh[1], (tuple, list)):
        shape, names = tuple(mesh[0]), tuple(mesh[1])
        if len(shape) != len(names):
            raise ShardingError(f"mesh={mesh!r}: {len(shape)} axis sizes but {len(names)} axis names")
        if not all(isinstance(s, (int, np.integer)) and s >= 1 for s in shape):
            raise ShardingError(f"mesh={mesh!r}: axis sizes must be positive integers")
        if not all(isinstance(a, str) for a in names):
            raise ShardingError(f"mesh={mesh!r}: axis names must be strings")
        return MeshSpec(_take_devices(math.prod(shape)), Mesh(names, tuple(int(s) for s in shape)), True)
    raise ShardingError(f"mesh={mesh!r} is not a device count, a jax.sharding.Mesh, or (shape, axis_names); "
                        "pass e.g. mesh=8 or mesh=((2, 4), ('dp', 'mp'))")
