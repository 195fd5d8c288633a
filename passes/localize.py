"""Pass ``localize``: from the global program to the one every rank runs.

Before: global shapes, layouts on every value.
After: every value has ``local_type`` (its per-rank block), every op has
``local_params``: params that carry shapes (``reshape.new_sizes``,
``broadcast_in_dim.shape``, ``iota.shape``) are rewritten to local shapes. The
program is the same on every rank; only collective groups and slice offsets
depend on the rank, and those the printer and the lowering compute per rank.
"""
from __future__ import annotations

from ..ir.graph import Graph, TensorType, is_collective

from .rules import LOCALIZERS


_JAX_SHARDING_PARAMS = ("sharding", "out_sharding")


class Localize:
    name = "localize"

    def __call__(self, graph: Graph) -> Graph:
        mesh = graph.mesh
        local_types: dict = {}   # (layout, type) -> the local type; values share few of each
        for v in graph.values():
            if v.layout is None:
                v.local_type = v.type
                continue
            key = (id(v.layout), id(v.type))   # both live as long as the graph
            t = local_types.get(key)
            if t is None:
                t = local_types[key] = TensorType(v.layout.local_shape(v.type.shape, mesh), v.type.dtype)
            v.local_type = t
        for op in graph.ops:
            for body in op.subgraphs:
                self(body)
            fn = LOCALIZERS.get(op.kind)
            if fn is None or is_collective(op):
                op.local_params = dict(op.params)
            else:
                op.local_params = fn(op, [v.local_type.shape for v in op.inputs],
                                     [v.local_type.shape for v in op.outputs])
            for key in _JAX_SHARDING_PARAMS:
                # jax's own sharding hints (set when traced under a mesh) describe the global
                # program; the per-rank program is already partitioned
                if op.local_params.get(key) is not None:
                    op.local_params[key] = None
        return graph
