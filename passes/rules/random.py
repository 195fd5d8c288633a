"""Random numbers: PRNG keys and the primitives jax emits for ``jax.random``.

A key array (``key<fry>[S]``) is a value of its own dtype in the IR: one element
per key, its internal words (two uint32 for threefry) are no dim of the IR, so
no rule can split them. Dims of a *batch* of keys are elementwise: a device
holding some keys holds them whole.

``random_bits(key[S]) -> u32[S + shape]``: the key dims are shared with the
leading result dims. The drawn dims may be split only where a device can draw
its block alone and get exactly the bits one device would: jax's partitionable
threefry (the default) computes the bit at global position i from the key and
the counter i alone, so the lowering (runtime/random_bits.py) hashes the
counters of its block. With the original threefry, or another PRNG
implementation, the drawn dims stay whole (every device draws all of it,
takes its block locally, and no communication is needed).

``random_split`` makes new keys: the new dims stay whole (keys are a few bytes;
a device that needs a subset of them slices it locally).
"""
from __future__ import annotations

from .base import FactorBuilder, FactorRule, numel, register, register_localizer
from .elementwise import elementwise_rule

THREEFRY = "key<fry>"

# threefry2x32 does 20 rounds of add/rotate/xor per pair of words: an estimate of
# its work per element, so that repeating a draw on every device is not free
_THREEFRY_OPS = 60


def blockwise_bits(op) -> bool:
    """Can a device draw its block of this ``random_bits`` alone (counter-based threefry)?"""
    return op.inputs[0].type.dtype == THREEFRY and bool(op.params.get("counters"))


@register("random_bits")
def random_bits_rule(op) -> FactorRule:
    fb = FactorBuilder()
    keys = fb.dims(op.inputs[0].type.shape)
    drawn = fb.dims(op.params["shape"])
    # a block's offsets are int32 (axis_index * block size): a dim of 2**31 or more stays whole
    whole = tuple(f for fs, n in zip(drawn, op.params["shape"]) for f in fs
                  if not blockwise_bits(op) or n >= 2 ** 31)
    out = op.outputs[0].type.shape
    return FactorRule(tuple(fb.sizes), (keys,), (keys + drawn,), need_replication=frozenset(whole),
                      flops=numel(out) * _THREEFRY_OPS)


@register_localizer("random_bits")
def _random_bits_local(op, in_shapes, out_shapes):
    # ``counters`` is the compiler's note (set at import), not a param of jax's primitive;
    # ``shape`` is the drawn block (the lowering draws it at the block's global offsets)
    params = {k: v for k, v in op.params.items() if k != "counters"}
    params["shape"] = tuple(out_shapes[0][len(in_shapes[0]):])
    return params


@register("random_split")
def random_split_rule(op) -> FactorRule:
    fb = FactorBuilder()
    keys = fb.dims(op.inputs[0].type.shape)
    new = fb.dims(op.params["shape"])
    return FactorRule(tuple(fb.sizes), (keys,), (keys + new,),
                      need_replication=frozenset(f for fs in new for f in fs),
                      flops=numel(op.outputs[0].type.shape) * _THREEFRY_OPS)


@register("random_wrap")
def random_wrap_rule(op) -> FactorRule:
    """``u32[S, 2] -> key[S]``: the trailing key words take no factor, so they stay whole."""
    fb = FactorBuilder()
    keys = fb.dims(op.outputs[0].type.shape)
    words = ((),) * (op.inputs[0].type.rank - len(keys))
    return FactorRule(tuple(fb.sizes), (keys + words,), (keys,), flops=0)


@register("random_unwrap")
def random_unwrap_rule(op) -> FactorRule:
    """``key[S] -> u32[S, 2]``."""
    fb = FactorBuilder()
    keys = fb.dims(op.inputs[0].type.shape)
    words = ((),) * (op.outputs[0].type.rank - len(keys))
    return FactorRule(tuple(fb.sizes), (keys,), (keys + words,), flops=0)


@register("random_gamma")
def random_gamma_rule(op) -> FactorRule:
    """``random_gamma(key[K], a[K + T])``: each key is split into one key per element of
    its ``T`` block, numbered by position there, so ``T`` stays whole; ``K`` is elementwise."""
    fb = FactorBuilder()
    shape = op.outputs[0].type.shape
    dims = fb.dims(shape)
    k = op.inputs[0].type.rank
    return FactorRule(tuple(fb.sizes), (dims[:k], dims), (dims,),
                      need_replication=frozenset(f for fs in dims[k:] for f in fs),
                      flops=numel(shape) * _THREEFRY_OPS)


# one key (or one result) per element: seeds, fold_in's messages, threefry2x32's
# counters (its key words are scalars or match the counters)
@register("random_seed", "random_fold_in", "random_clone", "threefry2x32")
def _per_element(op) -> FactorRule:
    rule = elementwise_rule(op)
    work = 0 if op.kind == "random_clone" else numel(op.outputs[0].type.shape) * _THREEFRY_OPS
    return FactorRule(rule.sizes, rule.operands, rule.results, flops=work)


@register("bitcast_convert_type")
def bitcast_rule(op) -> FactorRule:
    """Reinterprets bits (``uniform`` turns random uint32 into float32). Between widths a
    trailing dim of words appears or goes (``u32[N] -> u8[N, 4]``); it stays whole."""
    src, dst = op.inputs[0].type, op.outputs[0].type
    fb = FactorBuilder()
    common = fb.dims(src.shape if src.rank <= dst.rank else dst.shape)
    return FactorRule(tuple(fb.sizes), (common + ((),) * (src.rank - len(common)),),
                      (common + ((),) * (dst.rank - len(common)),), flops=numel(dst.shape))
