"""``shard_map``: per-device code the user wrote as such (OneFlow's mirrored view).

The op's boundary is fixed, like a user mark: its operands must arrive in its
``in_specs`` layouts and its results leave in its ``out_specs`` layouts (a mesh axis
a spec does not name replicates the tensor over it, as in jax). Its body, kept in
``params["body"]`` over per-device shapes, is neither planned nor localized: it runs
as written, with the user's own collectives (runtime/lower.py).

The rule has one factor per axis of the shard_map's mesh, and a spec dim is made of
the factors of the axes it names (major first). A strategy is then nothing but the
binding of the user's mesh axes to the program's: each axis to itself on the
parallelize mesh, or, on a mesh built from a device count (axes ``d0, d1, ...``), to
a run of its prime axes. ``fixed_factors`` works the binding out (propagation seeds
the op with it, and neighbours propagate from it); the localizer renames the body's
collectives by it, so the per-rank dumps show what runs.
"""
from __future__ import annotations

from ...ir.errors import sharding_error
from ...ir.graph import Graph, Op
from ...ir.mesh import Mesh, bind_runs

from .base import FactorRule, register, register_localizer

# params of jax's collectives that name mesh axes (``axes`` of reduce_sum holds ints: left alone)
_AXIS_PARAMS = ("axes", "axis_name")
# jax's sharding hints in per-device code refer to the user's mesh; the program is partitioned already
_JAX_SHARDING_PARAMS = ("sharding", "out_sharding")


@register("shard_map")
def shard_map_rule(op: Op) -> FactorRule:
    names = [n for n, _ in op.params["mesh"]]
    factor = {n: f for f, n in enumerate(names)}

    def tensor(spec):
        return tuple(tuple(factor[a] for a in dim) for dim in spec.dims)
    # The body's work does not depend on any choice made around it: no flops to weigh.
    return FactorRule(tuple(s for _, s in op.params["mesh"]), tuple(tensor(s) for s in op.params["in_specs"]),
                      tuple(tensor(s) for s in op.params["out_specs"]), flops=0.0)


def fixed_factors(op: Op, mesh: Mesh) -> tuple:
    """The program's mesh axes each axis of the shard_map's mesh stands for (a size-1
    axis stands for none), or a ShardingError naming the op when they do not fit."""
    user = op.params["mesh"]
    if all(n in mesh.axis_names and mesh.axis_size(n) == s for n, s in user):
        return tuple((n,) if s > 1 else () for n, s in user)
    if not _from_device_count(mesh):
        # (jax itself refuses a shard_map whose mesh is not the one traced under, the parallelize mesh)
        raise _mesh_error(op, f"the shard_map's mesh ({_mesh_words(user)}) is not the parallelize mesh ({mesh})",
                          "run the shard_map on the parallelize mesh (pass the same jax Mesh, or omit mesh= inside "
                          "the function to use it)")
    runs = bind_runs([s for _, s in user], mesh)
    if runs is None:
        raise _mesh_error(op, f"the shard_map's mesh ({_mesh_words(user)}) does not map onto the {mesh.size} devices' "
                              f"axes ({mesh}) in order", "parallelize on a named mesh with the shard_map's axes "
                              "(mesh=<the jax Mesh>, or mesh=(shape, axis_names))")
    return tuple(runs)


def _from_device_count(mesh: Mesh) -> bool:
    """A mesh built from a device count: its prime axes are named d0, d1, ... (runtime/mesh.py)."""
    return mesh.axis_names == tuple(f"d{i}" for i in range(len(mesh.axis_names)))


def _mesh_words(user) -> str:
    return " ".join(f"{n}={s}" for n, s in user)


def _mesh_error(op: Op, problem: str, fix: str):
    specs = (f"in_specs=({', '.join(map(str, op.params['in_specs']))}) "
             f"out_specs=({', '.join(map(str, op.params['out_specs']))})")
    return sharding_error(problem, operator="shard_map", source=op.source,
                          shapes=tuple(v.type.shape for v in op.inputs), strategy=specs, fix=fix)


@register_localizer("shard_map")
def localize_body(op: Op, in_shapes, out_shapes) -> dict:
    """The body is per-device code already: its local types are its types, its local
    params its params, with the user's mesh axes renamed to the program's axes the
    strategy binds them to."""
    bound = dict(zip((n for n, _ in op.params["mesh"]), op.strategy.factors))
    # on the parallelize mesh itself every axis stands for itself (a size-1 one binds no
    # axis, but keeps its name there)
    same = all(axes in ((n,), ()) for n, axes in bound.items())
    rename = {} if same else {n: axes for n, axes in bound.items() if axes != (n,)}
    body: Graph = op.params["body"]
    for graph in [body] + [sub for _, o in body.walk_ops() for sub in o.subgraphs]:
        for v in graph.values():
            v.local_type = v.type
    for _, inner in body.walk_ops():
        params = dict(inner.params)
        for key in _JAX_SHARDING_PARAMS:
            if params.get(key) is not None:
                params[key] = None
        if rename:
            for key in _AXIS_PARAMS:
                if key in params:
                    params[key] = _renamed(params[key], rename, inner, op)
        inner.local_params = params
    return dict(op.params)


def _renamed(value, rename: dict, inner: Op, op: Op):
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, tuple) or not any(isinstance(a, str) for a in value):
        return value
    out = tuple(b for a in value for b in (rename.get(a, (a,)) if isinstance(a, str) else (a,)))
    if not out:
        raise _mesh_error(op, f"{inner.kind} at {inner.source} in its body works over mesh axes {value} of size 1, "
                              "which a mesh built from a device count has no axes for",
                          "parallelize on a named mesh with the shard_map's axes")
    return out


FIXED = {"shard_map": fixed_factors}   # ops whose layouts the program fixes: op kind -> its factors on a mesh
