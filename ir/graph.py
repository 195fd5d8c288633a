"""The program the passes transform: SSA values and the ops that define them.

A ``Graph`` is a flat list of ops in program order over ``Value``s. Values carry
their global ``TensorType`` and, once propagation has run, a ``Layout``; after
localization they also carry the per-rank ``local_type``. Ops carry the jax
primitive name (``kind``), its params, the user's source line, and what the
passes decided about them (``strategy``, ``origin``).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from .layout import Layout
from .mesh import Mesh

_ids = itertools.count()

# Ops the passes create (everything else is a jax primitive name).
CONSTRAINT = "sharding_constraint"  # identity that pins a layout (user strategies)
RESHARD = "reshard"                 # layout change, before it is planned
COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "slice", "permute")


def is_collective(op: "Op") -> bool:
    """A redistribution step the planner inserted (jax's own ``slice`` primitive has a
    ``prim``; the planner's local ``slice`` does not)."""
    return op.prim is None and op.kind in COLLECTIVE_KINDS


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self):
        # worked out once: the planner asks for these (and hashes types in memo keys)
        # hundreds of thousands of times on a large model
        object.__setattr__(self, "rank", len(self.shape))
        object.__setattr__(self, "itemsize", _ITEMSIZE.get(self.dtype, 4))
        object.__setattr__(self, "nbytes", math.prod(self.shape) * self.itemsize)
        object.__setattr__(self, "_hash", hash((self.shape, self.dtype)))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return f"{_SHORT.get(self.dtype, self.dtype)}[{','.join(map(str, self.shape))}]"


_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int32": "i32",
          "int64": "i64", "int8": "i8", "int16": "i16", "uint8": "u8", "uint32": "u32", "bool": "bool",
          "float8_e4m3fn": "f8e4m3", "float8_e5m2": "f8e5m2", "uint64": "u64", "uint16": "u16"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4, "int64": 8, "int8": 1,
             "int16": 2, "uint8": 1, "uint32": 4, "bool": 1, "uint64": 8, "uint16": 2,
             "float8_e4m3fn": 1, "float8_e5m2": 1}


class Value:
    """One SSA value. Identity is the object itself."""

    __slots__ = ("id", "type", "layout", "local_type", "literal", "const", "name_hint")

    def __init__(self, type: TensorType, *, layout: Optional[Layout] = None, literal: Any = None,
                 const: Any = None, name_hint: str = ""):
        self.id = next(_ids)
        self.type = type
        self.layout = layout
        self.local_type: Optional[TensorType] = None
        self.literal = literal      # a Python/NumPy scalar baked into the program
        self.const = const          # a closed-over array, fed to the program as an input
        self.name_hint = name_hint

    @property
    def is_literal(self) -> bool:
        return self.literal is not None

    def __repr__(self) -> str:
        return f"Value#{self.id}:{self.type}"


@dataclass(eq=False)
class Op:
    kind: str
    inputs: list[Value]
    outputs: list[Value]
    params: dict = field(default_factory=dict)
    source: Optional[str] = None
    prim: Any = None                       # the jax primitive, for lowering; opaque to passes
    strategy: Any = None                   # passes.strategy.OpStrategy once decided
    origin: str = ""                       # "user", "default", or where it was propagated from
    region: Optional[int] = None           # shard() call this op belongs to
    note: str = ""                         # free text for dumps (e.g. what a reshard serves)
    pinned: Optional[Layout] = None        # sharding_constraint: the layout the user fixed
    local_params: Optional[dict] = None    # params rewritten for local shapes (after localize)
    subgraphs: list = field(default_factory=list)  # bodies of scan / while / cond, as Graphs
    origin_op: Optional["Op"] = None       # the op whose choice ``origin`` names (origin chains)

    def describe(self) -> str:
        """Operator, source line and shapes, for error messages."""
        shapes = ", ".join(str(v.type) for v in self.inputs)
        where = f" at {self.source}" if self.source else ""
        return f"{self.kind}{where} with operands ({shapes})"


# ``source`` and ``origin`` may be given as a lookup to run on first use (a jax
# traceback to search, a propagation choice to put into words): most compiles
# never print them, and working them out for every op costs as much as planning.
def _lazy(name: str) -> property:
    slot = "_" + name

    def get(self):
        v = self.__dict__.get(slot)
        if v is not None and not isinstance(v, str):
            v = self.__dict__[slot] = v()
        return v

    def set(self, v):
        self.__dict__[slot] = v
    return property(get, set)


Op.source = _lazy("source")
Op.origin = _lazy("origin")


@dataclass(eq=False)
class Graph:
    mesh: Mesh
    inputs: list[Value]
    outputs: list[Value]
    ops: list[Op]
    name: str = "main"
    input_names: list[str] = field(default_factory=list)
    num_user_inputs: int = -1                      # inputs after these are closed-over constants
    regions: dict = field(default_factory=dict)    # shard() call id -> compiler.region_registry.Region
    pinned_inputs: dict = field(default_factory=dict)   # input index -> Layout fixed by the user
    pinned_outputs: dict = field(default_factory=dict)  # output index -> Layout fixed by the user
    tied_outputs: dict = field(default_factory=dict)    # output index -> input index it must match (loop state)
    donated_inputs: frozenset = frozenset()        # input indices whose buffers the step may reuse (donate_argnums)
    count_mesh: bool = False                       # mesh built from a device count: axes may be reordered
    call_source: Optional[str] = None              # where parallelize was called (errors about in/out strategies)
    auto: Any = None                               # mode="auto": the search's result (plan.cost, plan.explain())

    def walk_ops(self) -> Iterator[tuple["Graph", Op]]:
        """Every op with the graph it sits in, descending into loop and branch bodies."""
        for op in self.ops:
            yield self, op
            for sub in op.subgraphs:
                yield from sub.walk_ops()

    def set_mesh(self, mesh: Mesh) -> None:
        self.mesh = mesh
        for _, op in self.walk_ops():
            for sub in op.subgraphs:
                sub.mesh = mesh

    def producers(self) -> dict[Value, Op]:
        return {v: op for op in self.ops for v in op.outputs}

    def users(self) -> dict[Value, list[Op]]:
        out: dict[Value, list[Op]] = {}
        for op in self.ops:
            for v in op.inputs:
                out.setdefault(v, []).append(op)
        return out

    def values(self) -> Iterator[Value]:
        seen = set()
        for v in itertools.chain(self.inputs, (v for op in self.ops for v in op.inputs + op.outputs)):
            if v.id not in seen:
                seen.add(v.id)
                yield v
