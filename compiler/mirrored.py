"""Importing a user's ``jax.shard_map`` (OneFlow's mirrored view) into the program.

The equation becomes one ``shard_map`` op. Its ``in_specs`` / ``out_specs`` are kept
as layouts over the shard_map's own mesh axes (passes/rules/mirrored.py binds them
to the program's mesh), and its body, as a graph over per-device shapes, in
``params["body"]``: per-device code, neither planned nor localized, run as written.

jax traces the body with its varying-axes types (``check_vma=True``, the default).
The program runs without them (layouts are this compiler's business), so the few
primitives that exist only for those types are imported as what they compute on a
device: ``pvary`` / ``pcast`` are identities (jaxpr_import.py), ``psum_invariant`` is a
``psum``, ``all_gather_invariant`` an ``all_gather``.
"""
from __future__ import annotations

import os
import traceback
from contextlib import contextmanager

from jax import lax
from jax.extend import core as jcore

from ..ir.errors import sharding_error
from ..ir.graph import Op, Value
from ..ir.layout import Layout

from .jaxpr_import import (CONTROL_FLOW, IDENTITIES, INLINE, LAYOUT_REQUESTS, Importer, register_control_flow,
                           tensor_type)
from .source_lines import is_library_frame


class _AxisIndex:
    """``axis_index`` over every axis it names, as their linear index: on a mesh built
    from a device count one user axis stands for several (passes/rules/mirrored.py),
    and the primitive takes one axis where ``lax.axis_index`` combines several."""
    name = "axis_index"
    multiple_results = False

    @staticmethod
    def bind(*, axis_name):
        return lax.axis_index(axis_name)


# primitive -> (what computes the same per device without vma types, params it needs besides)
_WITHOUT_VMA = {"psum_invariant": (lax.psum_p, {"axis_index_groups": None}),
                "all_gather_invariant": (lax.all_gather_p, {"axis_index_groups": None}),
                "axis_index": (_AxisIndex, {})}


class _PerDevice(Importer):
    """The importer of a shard_map body (and of the loops and branches in it)."""

    def _eqn(self, eqn, ins, name, source) -> list[Value]:
        if name in _WITHOUT_VMA:
            prim, extra = _WITHOUT_VMA[name]
            outs = [Value(tensor_type(v.aval)) for v in eqn.outvars]
            self.ops.append(Op(prim.name, ins, outs, {**eqn.params, **extra}, source, prim=prim))
            return outs
        if name in LAYOUT_REQUESTS:
            # a layout over the axes a partly manual shard_map leaves to jax: on this device
            # the value is whole along them already
            return ins
        if name in ("shardprop_mark", "shard_map"):
            what = "a shard() mark" if name == "shardprop_mark" else "a shard_map"
            raise sharding_error(f"{what} inside a shard_map body: the body is per-device code, which shardprop "
                                 "runs as written and does not partition", operator=name, source=source(),
                                 shapes=tuple(v.type.shape for v in ins),
                                 fix="move it out of the shard_map, around the call")
        if name in CONTROL_FLOW or name in IDENTITIES or name in INLINE and INLINE[name] in eqn.params:
            return super()._eqn(eqn, ins, name, source)
        # bound with jax's own params: none of the annotations the program's ops get
        outs = [Value(tensor_type(v.aval)) for v in eqn.outvars]
        self.ops.append(Op(name, ins, outs, dict(eqn.params), source, prim=eqn.primitive))
        return outs


@register_control_flow("shard_map")
def import_shard_map(imp: Importer, eqn, ins: list, outs: list, source) -> Op:
    """A user's shard_map: an op with fixed boundary layouts around per-device code."""
    p = eqn.params
    jaxpr = p["jaxpr"] if isinstance(p["jaxpr"], jcore.ClosedJaxpr) else jcore.ClosedJaxpr(p["jaxpr"], [])
    mesh = p["mesh"]
    axes = tuple((str(n), int(s)) for n, s in zip(mesh.axis_names, mesh.axis_sizes))
    in_specs = [_layout(s, v.type.rank, source, "in_specs") for s, v in zip(p["in_specs"], ins)]
    out_specs = [_layout(s, v.type.rank, source, "out_specs") for s, v in zip(p["out_specs"], outs)]
    per_device = _PerDevice(imp.marked_regions)
    body, hoisted = per_device.body(jaxpr, source)
    imp.consts.extend(per_device.consts)   # arrays the body closes over: the program's constants, replicated
    params = {"mesh": axes, "in_specs": tuple([Layout.replicated(v.type.rank) for v in hoisted] + in_specs),
              "out_specs": tuple(out_specs), "check_vma": bool(p.get("check_vma", True)), "body": body}
    op = Op("shard_map", hoisted + list(ins), outs, params, source, prim=eqn.primitive)
    op.origin = "user (shard_map in_specs/out_specs)"
    return op


def _layout(spec, rank: int, source, which: str) -> Layout:
    """A PartitionSpec as a layout over the shard_map's mesh axes."""
    if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
        raise sharding_error(f"{which} entry {spec} has unreduced/reduced axes, which shardprop does not support "
                             "at a shard_map boundary", operator="shard_map", source=source(), strategy=str(spec),
                             fix="psum the value inside the body (or outside, after the shard_map)")
    entries = tuple(spec) + (None,) * (rank - len(tuple(spec)))
    return Layout(tuple(() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in entries[:rank]))


@contextmanager
def shard_map_errors():
    """jax's own checks of a shard_map call (its mesh is not the context mesh, a spec
    names an axis its mesh lacks), raised while tracing, as a ShardingError that names
    the user's line."""
    try:
        yield
    except ValueError as e:
        line = _user_line(e.__traceback__)
        if "shard_map" not in str(e) or line is None:
            raise
        raise sharding_error(_one_line(str(e)), operator="shard_map", source=line,
                             fix="correct the call as jax says; inside parallelize a shard_map runs on the "
                                 "parallelize mesh (omit mesh=, or pass the same jax Mesh) and its specs name "
                                 "that mesh's axes") from e


def _user_line(tb) -> str | None:
    """file.py:LINE of the innermost frame that is the user's code."""
    found = None
    for frame, lineno in traceback.walk_tb(tb):
        if not is_library_frame(frame.f_code.co_filename):
            found = f"{os.path.basename(frame.f_code.co_filename)}:{lineno}"
    return found


def _one_line(message: str) -> str:
    """jax's message, its lines joined (up to the note on filtered frames)."""
    lines = []
    for line in message.splitlines():
        if line.startswith("-----"):
            break
        if line.strip():
            lines.append(line.strip())
    return " ".join(lines)
