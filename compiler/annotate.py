"""``shard()``: marking one operator call with a strategy.

The marked call is bracketed by an identity primitive, ``shardprop_mark``, on
every array input (role "in") and output (role "out"). The marks survive
``jit``, ``grad`` (a mark's tangent is passed through unmarked, so only the
forward computation carries the strategy) and ``vmap`` (a batched mark records
the inserted dimension, which stays unsplit). The strategy itself lives in the
call's ``Region``, which the marks' ``region`` param (an int) holds, so the primitive's
params stay small and hashable (compiler/region_registry.py).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec

from ..ir.errors import sharding_error

from .region_registry import Region, TensorStrategy, new_region_id, record
from .regions import factor_classes
from .source_lines import caller_source

mark_p = Primitive("shardprop_mark")
mark_p.def_impl(lambda x, **_: x)
mark_p.def_abstract_eval(lambda x, **_: x)
mlir.register_lowering(mark_p, mlir.lower_fun(lambda x, **_: x, multiple_results=False))


def _mark_jvp(primals, tangents, **params):
    (x,), (t,) = primals, tangents
    return mark_p.bind(x, **params), t


def _mark_batch(args, dims, *, batch_dims, **params):
    (x,), (d,) = args, dims
    if d is batching.not_mapped:
        return mark_p.bind(x, batch_dims=batch_dims, **params), d
    return mark_p.bind(x, batch_dims=batch_dims + (d,), **params), d


ad.primitive_jvps[mark_p] = _mark_jvp
batching.primitive_batchers[mark_p] = _mark_batch


def _fn_name(fn) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return name


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or hasattr(x, "aval")


def normalize_tensor_strategy(s, *, operator, source, which: str, strategy, shapes=None) -> TensorStrategy:
    """Check one tensor's strategy for type errors (shapes are checked at the call)."""
    if isinstance(s, PartitionSpec):
        axes = []
        for entry in s:
            if entry is None:
                axes.append(())
            elif isinstance(entry, str):
                axes.append((entry,))
            elif isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
                axes.append(tuple(entry))
            else:
                raise sharding_error(f"{which} has PartitionSpec entry {entry!r}; entries must be None, an axis "
                                     "name, or a tuple of axis names", operator=operator, source=source,
                                     shapes=shapes, strategy=strategy, fix="write e.g. PartitionSpec('dp', None)")
        return ("axes", tuple(axes))
    if isinstance(s, (tuple, list)):
        for k in s:
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
                raise sharding_error(f"{which} has split count {k!r}; split counts must be positive integers",
                                     operator=operator, source=source, shapes=shapes, strategy=strategy,
                                     fix=f"use integers, e.g. {tuple(int(x) if isinstance(x, (int, float)) and x >= 1 else 1 for x in s)}")
            if k < 1:
                raise sharding_error(f"{which} has split count {k}; split counts must be at least 1 "
                                     "(1 means not split)", operator=operator, source=source, shapes=shapes,
                                     strategy=strategy,
                                     fix="use 1 for a dimension that is not split")
        return ("splits", tuple(int(k) for k in s))
    raise sharding_error(f"{which} is {s!r}; expected a tuple of split counts such as (2, 4) or a "
                         "jax.sharding.PartitionSpec", operator=operator, source=source, shapes=shapes,
                         strategy=strategy,
                         fix="give one tuple per array input, e.g. ((2, 4), (4, 1))")


def normalize_strategy(strategy, *, operator, source, what: str, shapes=None) -> Optional[tuple[TensorStrategy, ...]]:
    if strategy is None:
        return None
    if isinstance(strategy, PartitionSpec) or not isinstance(strategy, (tuple, list)):
        strategy_t = (strategy,)
    else:
        strategy_t = tuple(strategy)
    # A bare tuple of ints is one tensor's strategy only if the caller meant one input;
    # MindSpore style always nests, so insist on nesting for clarity.
    if strategy_t and all(isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in strategy_t):
        raise sharding_error(f"{what} {strategy!r} is one tensor's split counts, but a strategy has one entry "
                             "per array input", operator=operator, source=source, shapes=shapes, strategy=strategy,
                             fix=f"wrap it: ({tuple(strategy_t)},)")
    return tuple(normalize_tensor_strategy(s, operator=operator, source=source, which=f"{what} entry {i}",
                                           strategy=strategy, shapes=shapes) for i, s in enumerate(strategy_t))


def check_against_shapes(strategies, shapes, *, operator, source, strategy, what: str) -> None:
    if len(strategies) != len(shapes):
        raise sharding_error(f"{what} has {len(strategies)} entries but the call has {len(shapes)} array "
                             f"{'inputs' if what == 'in_strategy' else 'outputs'}", operator=operator,
                             source=source, shapes=shapes, strategy=strategy,
                             fix=f"give exactly one entry per array {'input' if what == 'in_strategy' else 'output'}")
    for i, (s, shape) in enumerate(zip(strategies, shapes)):
        kind, body = s
        if kind == "axes":
            if len(body) > len(shape):
                raise sharding_error(f"{what} entry {i} names {len(body)} dims but that tensor has rank "
                                     f"{len(shape)}", operator=operator, source=source, shapes=shapes,
                                     strategy=strategy, fix=f"give at most {len(shape)} entries")
            continue
        if len(body) != len(shape):
            raise sharding_error(f"{what} entry {i} has {len(body)} split counts but that tensor has rank "
                                 f"{len(shape)} (shape {shape})", operator=operator, source=source,
                                 shapes=shapes, strategy=strategy,
                                 fix=f"give one split count per dimension, {len(shape)} in all")
        for d, (k, n) in enumerate(zip(body, shape)):
            if n % k:
                divisors = [x for x in range(1, n + 1) if n % x == 0]
                raise sharding_error(f"{what} entry {i} splits dim {d} (size {n}) into {k} parts, and {n} is "
                                     f"not divisible by {k}", operator=operator, source=source, shapes=shapes,
                                     strategy=strategy, fix=f"use a split count that divides {n}: "
                                     + ", ".join(map(str, divisors)))


def check_splits_agree(factors, ins, *, operator, source, shapes, strategy) -> None:
    """Dims that are one factor of the operator (a matmul's contracted dims) need one
    split: one split count, or the same mesh axes. Checked on the function itself, so
    also where autodiff later drops the forward op."""
    seen: dict[tuple, tuple[int, int, object]] = {}
    for k, ((kind, body), classes) in enumerate(zip(ins, factors.classes)):
        for d, c in enumerate(classes):
            split = body[d] if d < len(body) else ()    # a PartitionSpec may leave trailing dims out
            if (kind, c) not in seen:
                seen[(kind, c)] = (k, d, split)
                continue
            k1, d1, s1 = seen[(kind, c)]
            if s1 != split:
                how = "contracted together" if factors.reduced[c] else "the same dimension of the operator"
                prims = ", ".join(factors.operators)
                if kind == "splits":
                    fixed = [list(b) for _, b in ins]
                    fixed[k][d] = s1
                    said, fix = f"split {s1} and {split}", \
                        f"give them the same split count, e.g. {tuple(tuple(b) for b in fixed)}"
                else:
                    said = f"split over mesh axes {s1} and {split}"
                    fix = f"give them the same mesh axes (both {s1}, or both {split})"
                raise sharding_error(
                    f"input {k1} dim {d1} (size {shapes[k1][d1]}) and input {k} dim {d} (size {shapes[k][d]}) are "
                    f"{how} ({prims}), but are {said}", operator=operator, source=source,
                    shapes=shapes, strategy=strategy, fix=fix)


def shard(fn: Callable, in_strategy, out_strategy=None) -> Callable:
    """Mark one call of ``fn`` (an operator such as ``jnp.matmul``, or a small
    function) with a strategy, MindSpore style ``((2, 4), (4, 1))`` or JAX style
    ``(PartitionSpec('dp', 'mp'), PartitionSpec('mp', None))``.

    ``in_strategy`` has one entry per array input; ``out_strategy``, optional,
    one per array output. Outside ``parallelize`` the wrapped function computes
    exactly what ``fn`` does."""
    name = _fn_name(fn)
    operator = f"shard({name})"

    def check_given(source, shapes):
        if in_strategy is None and out_strategy is not None:
            raise sharding_error("out_strategy is given without an in_strategy", operator=operator, source=source,
                                 shapes=shapes, strategy=(None, out_strategy),
                                 fix="give in_strategy too (the out_strategy only says how the result is laid out)")
        if in_strategy is None:
            raise sharding_error("in_strategy is required", operator=operator, source=source, shapes=shapes,
                                 fix="pass e.g. shard(jnp.matmul, ((2, 4), (4, 1)))")
        ins = normalize_strategy(in_strategy, operator=operator, source=source, what="in_strategy", shapes=shapes)
        outs = normalize_strategy(out_strategy, operator=operator, source=source, what="out_strategy",
                                  shapes=shapes)
        return ins, outs

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        source = caller_source()
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        arrays = [i for i, x in enumerate(leaves) if _is_array(x)]
        shapes = tuple(tuple(np.shape(leaves[i])) for i in arrays)
        ins, outs = check_given(source, shapes)
        check_against_shapes(ins, shapes, operator=operator, source=source, strategy=in_strategy,
                             what="in_strategy")   # ranks first: the checks below index dims
        factors = None
        if any(kind == "splits" or any(body) for kind, body in ins):
            factors = factor_classes(fn, args, kwargs, arrays)
            check_splits_agree(factors, ins, operator=operator, source=source, shapes=shapes, strategy=in_strategy)
        rid = new_region_id()   # the marks hold it, and it holds the region (region_registry.py)
        leaves = list(leaves)
        for k, i in enumerate(arrays):
            leaves[i] = mark_p.bind(leaves[i], region=rid, index=k, role="in", batch_dims=())
        a, kw = jax.tree_util.tree_unflatten(tree, leaves)
        result = fn(*a, **kw)
        out_leaves, out_tree = jax.tree_util.tree_flatten(result)
        out_arrays = [i for i, x in enumerate(out_leaves) if _is_array(x)]
        out_shapes = tuple(tuple(np.shape(out_leaves[i])) for i in out_arrays)
        if outs is not None:
            check_against_shapes(outs, out_shapes, operator=operator, source=source, strategy=out_strategy,
                                 what="out_strategy")
        record(rid, Region(int(rid), name, source, ins, outs, shapes, out_shapes, in_strategy, out_strategy,
                           factors))
        out_leaves = list(out_leaves)
        for k, i in enumerate(out_arrays):
            out_leaves[i] = mark_p.bind(out_leaves[i], region=rid, index=k, role="out", batch_dims=())
        return jax.tree_util.tree_unflatten(out_tree, out_leaves)

    wrapped.shardprop_strategy = (in_strategy, out_strategy)
    return wrapped
