"""Tracing a JAX function into the compiler's ``Graph``: ``jax.make_jaxpr`` gives
the program (with the ``parallelize`` mesh set, so ``with_sharding_constraint``
names its axes), and compiler/jaxpr_import.py imports it.
"""
from __future__ import annotations

import jax

from ..ir.mesh import Mesh

from .jaxpr_import import import_jaxpr  # noqa: F401  (also part of this module's API: tests and bench import it)
from .mirrored import shard_map_errors   # (also registers the shard_map importer)


def input_names(fn, args, kwargs) -> list[str]:
    try:
        import inspect
        bound = inspect.signature(fn).bind(*args, **kwargs)
        named = dict(bound.arguments)
    except (TypeError, ValueError):
        named = {f"arg{i}": a for i, a in enumerate(args)} | dict(kwargs)
    names = []
    for key, val in named.items():
        for path, _ in jax.tree_util.tree_flatten_with_path(val)[0]:
            names.append(key + jax.tree_util.keystr(path))
    return names


def _abstract(x):
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False))
    return x


def trace(fn, args, kwargs, mesh: Mesh, context_mesh=None):
    """Trace ``fn(*args, **kwargs)`` into a Graph; also return the output pytree
    structure and the outputs' shapes. Tracing happens with ``context_mesh`` set, so
    ``with_sharding_constraint(x, PartitionSpec(...))`` inside ``fn`` names its axes."""
    # Trace shapes and dtypes only: arrays the caller placed on an Explicit-axes mesh
    # carry shardings in their types, which would clash with the tracing mesh and make
    # jax insert its own reshards. Layouts are this compiler's job.
    args, kwargs = jax.tree_util.tree_map(_abstract, (args, kwargs))
    with shard_map_errors():
        if context_mesh is not None:
            with jax.set_mesh(context_mesh):
                closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
        else:
            closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
    graph = import_jaxpr(closed, mesh, input_names(fn, args, kwargs), getattr(fn, "__name__", "main"))
    return graph, jax.tree_util.tree_structure(out_shape), out_shape
