"""Importing a closed jaxpr into the compiler's ``Graph``.

Calls that only structure the program (``jit``, ``custom_jvp_call``,
``custom_vjp_call``, ``remat``, ``closed_call``) are inlined, since after tracing
(and after autodiff, for a training step) only their primal bodies run. Loops and
branches become ops with nested graphs, through ``CONTROL_FLOW``, a registry of
handlers by primitive name (compiler/mirrored.py registers ``shard_map``'s).
``shard()`` marks become ``sharding_constraint`` ops, and the ops between a region's
input and output marks are tagged with it.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.extend import core as jcore

from ..ir.errors import sharding_error
from ..ir.graph import CONSTRAINT, Graph, Op, TensorType, Value
from ..ir.mesh import Mesh

from .region_registry import region_of
from .source_lines import SourceLine

# primitive name -> param holding the body to inline
INLINE = {"jit": "jaxpr", "pjit": "jaxpr", "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "custom_vjp_call_jaxpr": "fun_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr",
          "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}


class UnsupportedValue(TypeError):
    pass


# (shape, dtype) -> TensorType: a model has few distinct types. Bounded: emptied when it
# reaches _TYPES_MAX, so a long-lived process that meets ever new shapes keeps caching.
_TYPES: dict = {}
_TYPES_MAX = 65536


def tensor_type(aval) -> TensorType:
    key = (getattr(aval, "shape", None), getattr(aval, "dtype", None))
    try:
        t = _TYPES.get(key)
    except TypeError:   # an unhashable shape or dtype: checked the long way below
        t = None
    if t is None:
        t = _tensor_type(aval)
        if len(_TYPES) >= _TYPES_MAX:
            _TYPES.clear()
        try:
            _TYPES[key] = t
        except TypeError:
            pass
    return t


def _tensor_type(aval) -> TensorType:
    if not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
        raise UnsupportedValue(f"unsupported value type {aval}")
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        # a key array: one element per key, its internal data is no dim of the IR (``key<fry>``)
        return TensorType(tuple(int(s) for s in aval.shape), str(aval.dtype))
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        raise UnsupportedValue(f"values of type {aval.dtype} are not supported inside a parallelized function")
    return TensorType(tuple(int(s) for s in aval.shape), np.dtype(aval.dtype).name)


class Importer:
    def __init__(self, marked_regions: Optional[set] = None):
        self.ops: list[Op] = []
        self.consts: list[Value] = []
        # every shard() call met, also those whose result is unused: their strategies are checked too
        self.marked_regions: set = marked_regions if marked_regions is not None else set()

    def const(self, val) -> Value:
        arr = np.asarray(val) if not isinstance(val, jax.Array) else val
        if jax.dtypes.issubdtype(arr.dtype, jax.dtypes.prng_key):
            # a closed-over key is fed in as an input, even a single one: no literal holds a key
            v = Value(tensor_type(arr), const=arr, name_hint="const")
            self.consts.append(v)
            return v
        t = TensorType(tuple(arr.shape), np.dtype(arr.dtype).name if arr.dtype != jax.numpy.bfloat16 else "bfloat16")
        if arr.ndim == 0:
            return Value(t, literal=np.asarray(val))
        v = Value(t, const=arr, name_hint="const")
        self.consts.append(v)
        return v

    def const_input(self, val, type: TensorType) -> Value:
        """A constant fed to the program as an input (even a scalar, which ``const`` would bake in)."""
        v = Value(type, const=np.asarray(val, dtype=type.dtype if type.dtype != "bfloat16" else None),
                  name_hint="const")
        self.consts.append(v)
        return v

    def read(self, atom, env) -> Value:
        if isinstance(atom, jcore.Literal):
            val = atom.val
            if np.ndim(val) == 0:
                return Value(tensor_type(atom.aval), literal=np.asarray(val, dtype=np.dtype(atom.aval.dtype)))
            return self.const(val)
        return env[atom]

    def walk(self, jaxpr, consts: Sequence[Value], args: Sequence[Value], outer_source=None) -> list[Value]:
        env: dict[Any, Value] = {}
        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            ins = [self.read(a, env) for a in eqn.invars]
            name = eqn.primitive.name
            source = SourceLine(eqn.source_info, outer_source)
            try:
                outs = self._eqn(eqn, ins, name, source)
            except UnsupportedValue as e:
                raise sharding_error(str(e), operator=name, source=source(),
                                     shapes=tuple(v.type.shape for v in ins),
                                     fix="compute this value outside the parallelized function and pass the "
                                         "result in as an array") from None
            for var, val in zip(eqn.outvars, outs):
                if not isinstance(var, jcore.DropVar):
                    env[var] = val
        return [self.read(a, env) for a in jaxpr.outvars]

    def _eqn(self, eqn, ins, name, source) -> list[Value]:
        """Import one equation: inline a call, nest a loop/branch, or add an op."""
        if name in INLINE and INLINE[name] in eqn.params:
            body = eqn.params[INLINE[name]]
            if isinstance(body, jcore.ClosedJaxpr):
                return self.walk(body.jaxpr, [self.const(c) for c in body.consts], ins, source)
            return self.walk(body, [], ins, source)
        if name in _REGISTERED_ELSEWHERE and name not in CONTROL_FLOW:
            raise RuntimeError(f"no importer for {name} equations: import {_REGISTERED_ELSEWHERE[name]} "
                               "(compiler/trace.py does)")
        outs = [Value(tensor_type(v.aval)) for v in eqn.outvars]
        if name in CONTROL_FLOW:
            self.ops.append(CONTROL_FLOW[name](self, eqn, ins, outs, source))
        elif name == "shardprop_mark":
            self.marked_regions.add(eqn.params["region"])
            self.ops.append(Op(CONSTRAINT, ins, outs, dict(eqn.params), source))
        elif name in IDENTITIES:
            return ins   # only a type-level annotation (shard_map's varying axes): nothing to compute
        elif name in LAYOUT_REQUESTS and ins[0].is_literal:
            # a literal is the same scalar on every device (autodiff reshards its 1.0 seed onto
            # the mesh of a shard_map's output): nothing to lay out
            return ins
        elif name in LAYOUT_REQUESTS:
            # jax.lax.with_sharding_constraint: a layout the user asked for, kept as such
            self.ops.append(Op(CONSTRAINT, ins, outs, {"role": "with_sharding_constraint",
                                                       "user_spec": _spec_dims(eqn.params, ins[0].type.rank)},
                               source))
        else:
            params = dict(eqn.params)
            if name == "random_bits":
                # jax's partitionable threefry draws bit i from the key and counter i alone, so a
                # device can draw its block by itself (passes/rules/random.py)
                params["counters"] = bool(jax.config.jax_threefry_partitionable)
            self.ops.append(Op(name, ins, outs, params, source, prim=eqn.primitive))
        return outs

    def body(self, closed, source) -> tuple[Graph, list[Value]]:
        """A loop or branch body as a Graph. Arrays the body closes over become
        explicit leading inputs (and operands of the loop op, returned here), so
        that they are laid out and sliced like any other operand."""
        sub = type(self)(self.marked_regions)   # a shard_map body's loops are per-device code too
        jaxpr = closed.jaxpr
        const_in = [Value(tensor_type(np.asarray(c) if not isinstance(c, jax.Array) else c)) for c in closed.consts]
        args = [Value(tensor_type(v.aval)) for v in jaxpr.invars]
        outs = sub.walk(jaxpr, const_in, args, source)
        hoisted_in = [Value(v.type) for v in sub.consts]
        for inner, outer_in in zip(sub.consts, hoisted_in):
            for op in sub.ops:
                op.inputs = [outer_in if x is inner else x for x in op.inputs]
            outs = [outer_in if x is inner else x for x in outs]
        ops = _dead_code_elimination(sub.ops, outs)
        _tag_regions(ops)
        graph = Graph(None, hoisted_in + const_in + args, outs, ops, name="body")
        outer = [self.const(v.const) for v in sub.consts] + [self.const(c) for c in closed.consts]
        return graph, outer


def _scan_counts(params) -> tuple[int, int]:
    """(consts, carries) of a scan: jax 0.10 names the counts, 0.11 gives the groups."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()   # a jax FlatTree: len() counts its leaves
    return len(consts), len(carry)


def _scan(imp: Importer, eqn, ins, outs, source) -> Op:
    body, extra = imp.body(eqn.params["jaxpr"], source)
    consts, carry = _scan_counts(eqn.params)
    params = {"num_consts": consts + len(extra), "num_carry": carry, "length": eqn.params["length"],
              "reverse": eqn.params["reverse"], "unroll": eqn.params.get("unroll", 1)}
    return Op("scan", extra + ins, outs, params, source, prim=eqn.primitive, subgraphs=[body])


def _while(imp: Importer, eqn, ins, outs, source) -> Op:
    p = eqn.params
    cond, cond_extra = imp.body(p["cond_jaxpr"], source)
    body, body_extra = imp.body(p["body_jaxpr"], source)
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    operands = cond_extra + ins[:nc] + body_extra + ins[nc:nc + nb] + ins[nc + nb:]
    params = {"cond_nconsts": nc + len(cond_extra), "body_nconsts": nb + len(body_extra)}
    return Op("while", operands, outs, params, source, prim=eqn.primitive, subgraphs=[cond, body])


def _cond(imp: Importer, eqn, ins, outs, source) -> Op:
    """Branches share their operands; what one branch closes over the others take unused."""
    graphs, extras = zip(*(imp.body(b, source) for b in eqn.params["branches"]))
    total = [v for e in extras for v in e]
    for i, (g, e) in enumerate(zip(graphs, extras)):
        before = sum(len(x) for x in extras[:i])
        others_before = [Value(v.type) for v in total[:before]]
        others_after = [Value(v.type) for v in total[before + len(e):]]
        g.inputs = others_before + g.inputs[:len(e)] + others_after + g.inputs[len(e):]
    params = {k: v for k, v in eqn.params.items() if k != "branches"}
    params["num_hoisted"] = len(total)
    return Op("cond", [ins[0]] + total + ins[1:], outs, params, source, prim=eqn.primitive, subgraphs=list(graphs))


CONTROL_FLOW: dict[str, Callable] = {"scan": _scan, "while": _while, "cond": _cond}
# primitives that need a handler another module registers (an error, never a plain op, without it)
_REGISTERED_ELSEWHERE = {"shard_map": "shardprop.compiler.mirrored"}


def register_control_flow(name: str):
    """``@register_control_flow("shard_map")``: import equations of this primitive with
    ``fn(importer, eqn, ins, outs, source) -> Op`` (an op with nested graphs)."""
    def deco(fn):
        CONTROL_FLOW[name] = fn
        return fn
    return deco


# jax's own layout requests: with_sharding_constraint, and what jax inserts or the user
# calls on a mesh with Explicit axes (``jax.sharding.reshard``, ``mesh_cast``)
LAYOUT_REQUESTS = ("sharding_constraint", "reshard", "mesh_cast")
IDENTITIES = ("pvary", "pcast", "stage_boundary")   # stage_boundary: compiler/stages.py


def _spec_dims(params, rank: int) -> tuple:
    """The mesh axes per dim that a with_sharding_constraint's PartitionSpec names."""
    spec = getattr(params.get("sharding", params.get("dst_sharding")), "spec", None) or ()
    dims = []
    for entry in tuple(spec) + (None,) * (rank - len(tuple(spec))):
        dims.append(() if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry)))
    return tuple(dims[:rank])


def _dead_code_elimination(ops: list[Op], outputs: list[Value]) -> list[Op]:
    live = {v.id for v in outputs}
    kept = []
    for op in reversed(ops):
        if any(v.id in live for v in op.outputs):
            kept.append(op)
            live.update(v.id for v in op.inputs)
    return kept[::-1]


def _tag_regions(ops: list[Op]) -> None:
    """An op belongs to region R if it lies on a path from R's input marks to its
    output marks: found backwards from the output marks (a region's body is small),
    then kept if reachable forwards from its input marks within that set."""
    producers = {v.id: op for op in ops for v in op.outputs}
    users: dict[int, list[Op]] = {}
    for op in ops:
        for v in op.inputs:
            users.setdefault(v.id, []).append(op)
    marks: dict[int, dict[str, list[Op]]] = {}
    for op in ops:
        if op.kind == CONSTRAINT and "region" in op.params:
            marks.setdefault(op.params["region"], {"in": [], "out": []})[op.params["role"]].append(op)
    for rid, ends in marks.items():
        bwd, stack = set(), [producers[v.id] for m in ends["out"] for v in m.inputs if v.id in producers]
        while stack:
            op = stack.pop()
            if id(op) in bwd or op.kind == CONSTRAINT:
                continue
            bwd.add(id(op))
            stack.extend(producers[v.id] for v in op.inputs if v.id in producers)
        seen, stack = set(), [u for m in ends["in"] for v in m.outputs for u in users.get(v.id, [])]
        while stack:
            op = stack.pop()
            if id(op) in seen or id(op) not in bwd:
                continue
            seen.add(id(op))
            op.region = rid
            op.origin = "user"
            stack.extend(u for v in op.outputs for u in users.get(v.id, []))
        for m in ends["in"] + ends["out"]:
            m.region = rid


def import_jaxpr(closed, mesh: Mesh, names: list[str], name: str = "main") -> Graph:
    """A closed jaxpr as a Graph: calls inlined, control flow as nested graphs, dead code gone."""
    imp = Importer()
    consts = [imp.const(c) for c in closed.consts]
    inputs = []
    for v, n in zip(closed.jaxpr.invars, list(names) + [f"arg{i}" for i in range(len(closed.jaxpr.invars))]):
        try:
            inputs.append(Value(tensor_type(v.aval)))
        except UnsupportedValue as e:
            raise sharding_error(f"input {n}: {e}", operator=name,
                                 fix="pass plain arrays (or PRNG keys) as inputs") from None
    for v, n in zip(inputs, names):
        v.name_hint = n
    outputs = imp.walk(closed.jaxpr, consts, inputs)
    # a returned constant (``return x, 0.``) is fed in like a closed-over array
    outputs = [imp.const_input(v.literal, v.type) if v.is_literal else v for v in outputs]
    ops = _dead_code_elimination(imp.ops, outputs)
    _tag_regions(ops)
    live_consts = {v.id for op in ops for v in op.inputs} | {v.id for v in outputs}
    const_inputs = [v for v in imp.consts if v.id in live_consts]
    graph = Graph(mesh, inputs + const_inputs, outputs, ops, name=name,
                  input_names=list(names) + ["const"] * len(const_inputs), num_user_inputs=len(inputs))
    graph.set_mesh(mesh)
    graph.regions = {int(rid): region_of(rid) for rid in sorted(imp.marked_regions)}
    for _, op in graph.walk_ops():
        for body in op.subgraphs:
            body.regions = graph.regions
    return graph
