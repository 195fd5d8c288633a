"""A fuzz program as plain data: instructions over a pool of named values.

Only the inputs' types are stored; every other value's type is inferred by the
op families (``ops.py``), so a shrinker can drop an instruction or shrink a
shape and simply infer again (an inconsistent program raises ``Inconsistent``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Union

# dtypes: 'f32', 'i32' (values in [0, hi)), 'key' (typed jax.random.key), 'rawkey' (uint32[2] PRNGKey)
FLOAT, INT, KEY, RAWKEY = "f32", "i32", "key", "rawkey"


class Inconsistent(Exception):
    """An instruction's params do not fit its operands (after a shrink step)."""


@dataclass(frozen=True)
class TType:
    shape: tuple
    dtype: str = FLOAT
    hi: Optional[int] = None        # for i32 values: an exclusive upper bound

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


# One tensor's strategy: ("s", (2, 1)) split counts, or ("p", (None, "dp", ("a", "b"))) PartitionSpec entries.
Strategy = tuple


@dataclass
class Mark:
    ins: tuple                          # one Strategy per argument of the instruction
    outs: Optional[tuple] = None        # one Strategy per result, or None


@dataclass
class Instr:
    op: str                             # family name (ops.FAMILIES)
    args: tuple                         # value names
    params: dict
    outs: tuple                         # result names
    mark: Optional[Mark] = None
    unused: bool = False                # results are not returned (dead code on purpose)


MeshSpec = Union[int, tuple]            # 8, 4, or ((2, 4), ("dp", "mp"))


@dataclass
class Program:
    seed: int
    index: int
    inputs: dict                        # name -> TType, in argument order (batch last)
    instrs: list
    outputs: tuple                      # value names returned by f
    mesh: MeshSpec = 8
    mode: str = "sharding_propagation"
    in_strategy: dict = field(default_factory=dict)   # parallelize: input name -> Strategy
    out_strategy: Optional[tuple] = None              # parallelize: one Strategy or None per output
    wrapper: str = "fwd"                # fwd | grad | sgd | adam
    params: tuple = ()                  # sgd/adam: the inputs that are trained
    planted: Optional[str] = None       # what was made invalid on purpose (for the report only)
    bad_in_structure: bool = False      # parallelize in_strategy with one entry too many
    bad_out_structure: bool = False     # parallelize out_strategy with the wrong structure
    memory_share: Optional[float] = None  # mode="auto" under memory_limit = this share of its free plan's peak

    def copy(self) -> "Program":
        return dataclasses.replace(
            self, inputs=dict(self.inputs), instrs=[dataclasses.replace(i, params=dict(i.params)) for i in self.instrs],
            in_strategy=dict(self.in_strategy))

    @property
    def n_devices(self) -> int:
        return mesh_size(self.mesh)

    @property
    def named(self) -> bool:
        return not isinstance(self.mesh, int)

    def args_order(self) -> list:
        """Positional arguments of the traced step: params (as one dict), opt state, the rest."""
        return [n for n in self.inputs if n not in self.params]


def mesh_size(mesh: MeshSpec) -> int:
    if isinstance(mesh, int):
        return mesh
    n = 1
    for s in mesh[0]:
        n *= s
    return n


def mesh_axes(mesh: MeshSpec) -> dict:
    """Axis name -> size for a named mesh ({} for a device count)."""
    return {} if isinstance(mesh, int) else dict(zip(mesh[1], mesh[0]))


def infer(program: Program) -> dict:
    """name -> TType for every value; raises Inconsistent if an instruction does not fit."""
    from .ops import FAMILIES
    types = dict(program.inputs)
    for ins in program.instrs:
        try:
            arg_types = [types[a] for a in ins.args]
        except KeyError as e:
            raise Inconsistent(f"{ins.op} reads undefined {e}") from None
        outs = FAMILIES[ins.op].infer(arg_types, ins.params)
        if len(outs) != len(ins.outs):
            raise Inconsistent(f"{ins.op} gives {len(outs)} results, not {len(ins.outs)}")
        for t in outs:
            if any(d < 1 for d in t.shape) or t.size > 4096:
                raise Inconsistent(f"{ins.op} makes a value of shape {t.shape}")
        types.update(zip(ins.outs, outs))
    for o in program.outputs:
        if o not in types:
            raise Inconsistent(f"output {o} is undefined")
    return types
