"""Which values never reach memory: the fusion a compiler does, as the cost model sees it.

XLA (on CPU and GPU) fuses a chain of elementwise ops, with the broadcasts and
reshapes between them and a reduction at its end, into one loop: only the chain's
inputs are read from memory and only its outputs written. Adam's update is a dozen
elementwise ops per parameter; priced op by op it reads and writes every
intermediate, about five times what the fused loop moves, and a plan that repeats
the update on every device (data parallel) looks far slower than it runs.

A value is *resident* (kept in registers, no bytes touched for it) when the op that
makes it fuses into loops and every op that reads it does too (or is a reduction,
which reads its fused input in the same loop), and it is not an output of its
graph. A value read by a matmul, a collective, a loop or a gather is written to
memory. This is decided on a graph's structure alone: ``cost.tensor_factors`` leaves
resident values out of the bytes an op touches.
"""
from __future__ import annotations

from .rules.elementwise import KINDS as ELEMENTWISE

# ops a compiler fuses into an elementwise loop, as producers or consumers: no
# arithmetic across elements, each output element read from one input position (a
# transpose or reshape only moves where it is read from)
LOOP_FUSIBLE = ELEMENTWISE | {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose"}
# consumers that read a fused producer inside their own loop (an input fusion)
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"})


def resident_values(graph) -> frozenset:
    """The values of ``graph`` (not its loop bodies) that fusion keeps out of memory."""
    readers = graph.users()
    outputs = set(graph.outputs)
    out = set()
    for op in graph.ops:
        if op.kind not in LOOP_FUSIBLE or op.subgraphs:
            continue
        for v in op.outputs:
            users = readers.get(v)
            if users and v not in outputs and all(u.kind in LOOP_FUSIBLE or u.kind in REDUCTIONS
                                                  for u in users):
                out.add(v)
    return frozenset(out)


def unwritten_values(graph) -> frozenset:
    """The resident values that never get a buffer of their own: those with one reader,
    which fusion computes inside that reader's loop. A resident value with several
    readers (a forward value the backward reads again) is computed once and written
    where the readers land in different fusions, which the structure alone does not say."""
    readers = graph.users()
    return frozenset(v for v in resident_values(graph) if len(readers[v]) == 1)
