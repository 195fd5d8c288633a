"""One device's block of a ``random_bits`` draw, bit for bit what one device draws.

jax's partitionable threefry (``jax_threefry_partitionable``, the default) gives
the element at row-major position ``i`` of a draw of shape ``shape`` the hash
``threefry2x32(key, hi(i), lo(i))`` of its 64-bit counter ``i``, so a block can
be drawn alone from the counters of its own positions. Drawing a local-shaped
block with ``random_bits`` instead would number the block's elements from 0 and
draw different bits.

Counters are built from uint32 words (jax's own lowering uses uint64, which a
program without ``jax_enable_x64`` cannot name): one word while the draw has at
most 2**32 elements, a (hi, lo) pair with carries beyond.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

_U32 = np.uint32


def _mul_wide(x, c: int):
    """``x * c mod 2**64`` for uint32 ``x`` and a constant ``0 <= c < 2**64``, as (hi, lo) words:
    16-bit halves keep every partial product inside uint32."""
    c_lo, c_hi = c & 0xFFFFFFFF, c >> 32
    xl, xh = x & _U32(0xFFFF), x >> _U32(16)
    cl, ch = _U32(c_lo & 0xFFFF), _U32(c_lo >> 16)
    ll, lh, hl, hh = xl * cl, xl * ch, xh * cl, xh * ch
    mid = (ll >> _U32(16)) + (lh & _U32(0xFFFF)) + (hl & _U32(0xFFFF))
    lo = (ll & _U32(0xFFFF)) | (mid << _U32(16))
    hi = hh + (lh >> _U32(16)) + (hl >> _U32(16)) + (mid >> _U32(16)) + x * _U32(c_hi)
    return hi, lo


def _add_wide(a, b):
    lo = a[1] + b[1]
    return a[0] + b[0] + (lo < a[1]).astype(_U32), lo


def block_counters(shape: Sequence[int], block: Sequence[int], offsets: Sequence) -> tuple:
    """The 64-bit counters (hi, lo uint32 words, each of shape ``block``) of the
    positions of a block of a ``shape`` draw whose corner sits at ``offsets``
    (ints or traced scalars): ``sum_d (offset_d + j_d) * stride_d``."""
    rank = len(shape)
    block = tuple(block)
    if rank == 0:
        return jnp.zeros((), _U32), jnp.zeros((), _U32)
    strides = [math.prod(shape[d + 1:]) for d in range(rank)]
    wide = math.prod(shape) > 2 ** 32   # the largest counter, size - 1, needs the high word
    hi = lo = None
    for d in range(rank):
        idx = lax.iota(_U32, block[d]) + jnp.asarray(offsets[d]).astype(_U32)
        at = (1,) * d + (block[d],) + (1,) * (rank - d - 1)
        if wide:
            t_hi, t_lo = (t.reshape(at) for t in _mul_wide(idx, strides[d]))
            hi, lo = (t_hi, t_lo) if lo is None else _add_wide((hi, lo), (t_hi, t_lo))
        else:
            t_lo = (idx * _U32(strides[d])).reshape(at)
            lo = t_lo if lo is None else lo + t_lo
    lo = jnp.broadcast_to(lo, block)
    hi = jnp.zeros(block, _U32) if hi is None else jnp.broadcast_to(hi, block)
    return hi, lo


def random_bits_block(keys, bit_width: int, shape: Sequence[int], block: Sequence[int], offsets: Sequence):
    """The block (shape ``keys.shape + block``, corner at ``offsets`` within ``shape``) of
    ``random_bits(keys, bit_width, shape)`` under partitionable threefry."""
    hi, lo = block_counters(shape, block, offsets)

    def one_key(key):
        # the key words stay scalars: threefry2x32 broadcasts them (full-size copies would
        # ride through its loop as extra state)
        data = jax.random.key_data(key)
        return threefry2x32_p.bind(data[0], data[1], hi, lo)
    draw = one_key
    for _ in range(keys.ndim):   # a batch of keys: one draw per key, over the same counters
        draw = jax.vmap(draw)
    bits1, bits2 = draw(keys)
    dtype = np.dtype(f"uint{bit_width}")
    if bit_width == 64:
        return (lax.convert_element_type(bits1, dtype) << dtype.type(32)) | lax.convert_element_type(bits2, dtype)
    return lax.convert_element_type(bits1 ^ bits2, dtype)
