"""Differential checking: the parallel result must equal the single-device one."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import shardprop as sp

TOL = dict(rtol=1e-5, atol=1e-5)


def assert_trees_close(got, want, **tol):
    tol = tol or TOL
    g, gt = jax.tree_util.tree_flatten(got)
    w, wt = jax.tree_util.tree_flatten(want)
    assert gt == wt, f"structure differs: {gt} vs {wt}"
    for a, b in zip(g, w):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, f"{a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        np.testing.assert_allclose(a, b, **tol)


def scalarize(fn, args, seed=0):
    """A scalar loss of fn's float outputs (random cotangents), for checking gradients."""
    outs = jax.eval_shape(fn, *args)
    rng = np.random.default_rng(seed)
    cts = jax.tree_util.tree_map(lambda s: rng.standard_normal(s.shape).astype(s.dtype)
                                 if jnp.issubdtype(s.dtype, jnp.floating) else None, outs)

    def loss(*a):
        o = fn(*a)
        terms = [jnp.sum(x * c) for x, c in zip(jax.tree_util.tree_leaves(o), jax.tree_util.tree_leaves(cts))
                 if c is not None]
        return sum(terms)
    return loss


def check_parallel(fn, args, *, mesh=8, grads=True, argnums=None, **kwargs):
    """Run fn through parallelize (forward, and gradients w.r.t. float args) and
    compare with jax.jit(fn) on one device. Returns the forward ParallelFunction."""
    pf = sp.parallelize(fn, mesh=mesh, verify=True, **kwargs)
    assert_trees_close(pf(*args), jax.jit(fn)(*args))
    if grads:
        if argnums is None:
            argnums = tuple(i for i, a in enumerate(args) if jnp.issubdtype(np.asarray(a).dtype, jnp.floating))
        g = jax.grad(scalarize(fn, args), argnums=argnums)
        pg = sp.parallelize(g, mesh=mesh, verify=True, **kwargs)
        assert_trees_close(pg(*args), jax.jit(g)(*args))
    return pf


def rand(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)
