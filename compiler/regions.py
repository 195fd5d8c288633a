"""Which dims of a ``shard()`` call's inputs are the same factor.

MindSpore binds split counts to a device matrix built from an operator's
factors (for a matmul ``[i, k, j]``), so ``((2, 4), (4, 1))`` means: ``i`` split
2, ``k`` split 4 on both inputs. For any marked function we find those factors
by tracing it alone and joining input dims that a rule maps to the same factor.
This happens at the call, from the function itself, so it does not matter
whether autodiff later drops the forward op (a linear op's gradient does not
need it).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax

from ..ir.graph import Value
from ..passes.rules.dim_classes import DimClasses

from . import mirrored  # noqa: F401  (registers the shard_map importer: a marked function may hold one)
from .jaxpr_import import Importer, tensor_type


@dataclass(frozen=True)
class RegionFactors:
    classes: tuple[tuple[int, ...], ...]  # per array input, per dim: factor class (first-appearance order)
    reduced: tuple[bool, ...]             # per class: contracted/reduced inside the function
    operators: tuple[str, ...]            # the primitives the function is made of


def factor_classes(fn, args, kwargs, array_positions) -> RegionFactors:
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))

    def only_arrays(*arrays):
        full = list(leaves)
        for i, a in zip(array_positions, arrays):
            full[i] = a
        a, kw = jax.tree_util.tree_unflatten(tree, full)
        return fn(*a, **kw)

    avals = [jax.ShapeDtypeStruct(jax.numpy.shape(leaves[i]), jax.numpy.result_type(leaves[i]))
             for i in array_positions]
    closed = jax.make_jaxpr(only_arrays)(*avals)
    imp = Importer()
    inputs = [Value(tensor_type(v.aval)) for v in closed.jaxpr.invars]
    imp.walk(closed.jaxpr, [imp.const(c) for c in closed.consts], inputs)
    uf = DimClasses()
    uf.add_ops(imp.ops)
    reduced = uf.reduced_roots()
    index: dict = {}
    classes = []
    for v in inputs:
        row = []
        for d in range(v.type.rank):
            root = uf.find((v.id, d))
            row.append(index.setdefault(root, len(index)))
        classes.append(tuple(row))
    flags = [False] * len(index)
    for root, i in index.items():
        flags[i] = root in reduced
    return RegionFactors(tuple(classes), tuple(flags), tuple(sorted({op.kind for op in imp.ops})))
