"""Meshes: from what the user passes (a device count, a ``jax.sharding.Mesh``, a
``jax.sharding.AbstractMesh``, or ``(shape, axis_names)``) to the compiler's
``ir.Mesh`` and back to a jax Mesh over real devices (GPUs, or forced CPU devices
in tests).

A mesh need not be there to be planned for: an ``AbstractMesh``, or
``(shape, axis_names)`` needing more devices than jax sees, resolves to an
*abstract* ``MeshSpec`` (no devices). The compiler plans on it (its IR mesh is all
it needs); running on it is a ``ShardingError`` naming the devices needed and
present (``MeshSpec.require_devices``)."""
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
    abstract: bool = False   # planned for, not run on: no devices (an AbstractMesh, or larger than jax sees)

    def require_devices(self, what: str = "running the step") -> None:
        """A ShardingError if this mesh has no devices here: it can be planned, not run."""
        if self.abstract:
            raise ShardingError(_missing_devices(self.ir_mesh.size, what))

    def jax_mesh(self, ir_mesh: Mesh | None = None, axis_types: tuple = ()) -> JaxMesh:
        """The mesh the program runs on: Auto axes, the program's shard_map decides."""
        m = ir_mesh or self.ir_mesh
        if self.abstract:
            from jax.sharding import AbstractMesh
            return AbstractMesh(tuple(m.axis_sizes), tuple(m.axis_names),
                                axis_types=axis_types or (AxisType.Auto,) * len(m.axis_names))
        arr = np.empty(len(self.devices), dtype=object)
        arr[:] = list(self.devices)
        return JaxMesh(arr.reshape(m.axis_sizes), m.axis_names,
                       axis_types=axis_types or (AxisType.Auto,) * len(m.axis_names))

    def trace_mesh(self) -> JaxMesh | None:
        """The mesh set while tracing: the user's axis types, so code written for a mesh
        with Explicit axes (``jax.sharding.reshard``) traces as it would under jit."""
        if self.abstract:   # jax.set_mesh takes concrete meshes only: trace with none set
            return None
        return self.jax_mesh(axis_types=self.axis_types)


def _missing_devices(n: int, what: str) -> str:
    devices = jax.devices()
    platform = devices[0].platform if devices else "cpu"
    hint = (" On CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N or call "
            "jax.config.update('jax_num_cpu_devices', N) before jax initialises." if platform == "cpu" else "")
    return (f"{what} needs {n} devices but jax sees {len(devices)} ({platform}); a mesh larger than the "
            f"devices present can be planned (pstep.plan(*args) on jax.ShapeDtypeStructs, `shardprop plan`) "
            f"but not run or lowered.{hint}")


def _abstract(names: tuple, shape: tuple, axis_types: tuple = ()) -> MeshSpec:
    return MeshSpec((), Mesh(tuple(names), tuple(int(s) for s in shape)), True, tuple(axis_types), abstract=True)


def resolve_mesh(mesh: Any) -> MeshSpec:
    from jax.sharding import AbstractMesh
    if isinstance(mesh, AbstractMesh):
        return _abstract(tuple(mesh.axis_names), tuple(mesh.axis_sizes), tuple(mesh.axis_types))
    if isinstance(mesh, JaxMesh):
        return MeshSpec(tuple(mesh.devices.flat), Mesh(tuple(mesh.axis_names), tuple(mesh.devices.shape)), True,
                        tuple(mesh.axis_types))
    if isinstance(mesh, (int, np.integer)) and not isinstance(mesh, bool):
        n = int(mesh)
        if n < 1:
            raise ShardingError(f"mesh={mesh}: a device count must be at least 1")
        primes = prime_factors(n) or [1]
        names = tuple(f"d{i}" for i in range(len(primes)))
        if n > len(jax.devices()):   # a bare count means "these devices": say they are missing
            raise ShardingError(_missing_devices(n, "the mesh") + " To plan for absent devices, name the axes: "
                                f"mesh=(({n},), ('dp',)) or a jax.sharding.AbstractMesh.")
        return MeshSpec(tuple(jax.devices()[:n]), Mesh(names, tuple(primes)), False)
    if isinstance(mesh, (tuple, list)) and len(mesh) == 2 and isinstance(mesh[1], (tuple, list)):
        shape, names = tuple(mesh[0]), tuple(mesh[1])
        if len(shape) != len(names):
            raise ShardingError(f"mesh={mesh!r}: {len(shape)} axis sizes but {len(names)} axis names")
        if not all(isinstance(s, (int, np.integer)) and s >= 1 for s in shape):
            raise ShardingError(f"mesh={mesh!r}: axis sizes must be positive integers")
        if not all(isinstance(a, str) for a in names):
            raise ShardingError(f"mesh={mesh!r}: axis names must be strings")
        n = math.prod(shape)
        if n > len(jax.devices()):
            return _abstract(names, shape)
        return MeshSpec(tuple(jax.devices()[:n]), Mesh(names, tuple(int(s) for s in shape)), True)
    raise ShardingError(f"mesh={mesh!r} is not a device count, a jax.sharding.Mesh, a jax.sharding.AbstractMesh, "
                        "or (shape, axis_names); "
                        "pass e.g. mesh=8 or mesh=((2, 4), ('dp', 'mp'))")
