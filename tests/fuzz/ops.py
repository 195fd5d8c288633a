"""Op families of the fuzzer: how each draws its operands, infers its result types,
renders as Python, and which operand dims are one factor.

A family's ``classes`` gives, per argument and dim, a *key*: dims with one key are
one factor of the operator (a matmul's contracted dims, the matching dims of an
elementwise op), so a valid mark splits them alike. ``whole`` holds the keys of
dims the operator needs whole (a cumsum's axis, a sliced dim, scan's iteration
dim): a *mark* that splits one may be refused with a ShardingError. ``one`` holds
keys that must never be split (the words of a PRNG key).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from .program import FLOAT, INT, KEY, RAWKEY, Inconsistent, TType


@dataclass
class Classes:
    keys: list                          # per arg: list of keys, one per dim
    whole: set = field(default_factory=set)
    one: set = field(default_factory=set)


@dataclass
class Family:
    name: str
    feature: str
    weight: float
    gen: Callable                       # (g) -> (args, params) or None
    infer: Callable                     # (arg_types, params) -> [TType]
    render: Callable                    # (params, names, arg_types, tag) -> (prelude lines, expression)
    classes: Callable                   # (arg_types, params) -> Classes
    grad_ok: bool = True
    inner: Callable = None              # (params, arg_types) -> [(Strategy, shape)] marks inside a body
    mark_check: Callable = None         # (arg_types, params, splits of arg 0 per dim) -> why a mark may be refused


FAMILIES: dict[str, Family] = {}


def family(name, feature, weight, **kw):
    def deco(cls):
        FAMILIES[name] = Family(name, feature, weight, cls.gen, cls.infer, cls.render, cls.classes,
                                mark_check=getattr(cls, "mark_check", None), **kw)
        return cls
    return deco


def choice(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def tup(xs) -> str:
    xs = tuple(xs)
    return "(" + ", ".join(map(str, xs)) + ("," if len(xs) == 1 else "") + ")"


def own_keys(arg_types, tag="a"):
    return [[(tag, i, d) for d in range(t.rank)] for i, t in enumerate(arg_types)]


def need(cond, why):
    if not cond:
        raise Inconsistent(why)


def broadcast(shapes) -> tuple:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise Inconsistent(f"shapes {shapes} do not broadcast") from None


def bcast_keys(arg_types, out_shape, tag="o"):
    keys = []
    for i, t in enumerate(arg_types):
        off = len(out_shape) - t.rank
        keys.append([(tag, off + d) if n == out_shape[off + d] else ("b", i, d) for d, n in enumerate(t.shape)])
    return keys


def floats(ts):
    for t in ts:
        need(t.dtype == FLOAT, f"expected float operands, got {t.dtype}")


# -- elementwise ------------------------------------------------------------------------------------
UNARY = {"tanh": "jnp.tanh({0})", "relu": "jax.nn.relu({0})", "abs": "jnp.abs({0})", "neg": "-{0}",
         "sigmoid": "jax.nn.sigmoid({0})", "gelu": "jax.nn.gelu({0})", "scale": "{0} * 0.5",
         "shift": "{0} + 1.0", "iota": "{0} + jnp.arange({0}.shape[-1], dtype=jnp.float32)"}


@family("unary", "elementwise", 3.0)
class Unary:
    @staticmethod
    def gen(g):
        fn = choice(g.rng, list(UNARY))
        a = g.pick(pred=(lambda t: t.rank >= 1) if fn == "iota" else None)
        return (a,), {"fn": fn}

    @staticmethod
    def infer(ts, p):
        floats(ts)
        need(p["fn"] != "iota" or ts[0].rank >= 1, "iota needs rank >= 1")
        return [ts[0]]

    @staticmethod
    def render(p, names, ts, tag):
        return [], UNARY[p["fn"]].format(*names)

    @staticmethod
    def classes(ts, p):
        return Classes(bcast_keys(ts, ts[0].shape))


BINARY = {"add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "max": "jnp.maximum({0}, {1})",
          "min": "jnp.minimum({0}, {1})", "where": "jnp.where({0} > 0, {1}, {2})"}


@family("binary", "elementwise", 4.0)
class Binary:
    @staticmethod
    def gen(g):
        fn = choice(g.rng, list(BINARY))
        n = 3 if fn == "where" else 2
        a = g.pick()
        shape = g.types[a].shape
        args = [a]
        for _ in range(n - 1):
            if g.has("broadcast") and g.rng.random() < 0.5:
                args.append(g.pick(shape=g.broadcast_shape(shape)))
            else:
                args.append(g.pick(shape=shape))
        g.rng.shuffle(args)
        return tuple(args), {"fn": fn}

    @staticmethod
    def infer(ts, p):
        floats(ts)
        return [TType(broadcast([t.shape for t in ts]))]

    @staticmethod
    def render(p, names, ts, tag):
        return [], BINARY[p["fn"]].format(*names)

    @staticmethod
    def classes(ts, p):
        return Classes(bcast_keys(ts, broadcast([t.shape for t in ts])))


# -- contractions -----------------------------------------------------------------------------------
@family("matmul", "matmul", 2.5)
class Matmul:
    @staticmethod
    def gen(g):
        a = g.pick(pred=lambda t: 2 <= t.rank, rank=(2, 4))
        ta = g.types[a]
        batch = ta.shape[:-2]
        if batch and g.rng.random() < 0.4:
            batch = batch[int(g.rng.integers(len(batch) + 1)):]     # b broadcasts over a's leading dims
        b = g.pick(shape=batch + (ta.shape[-1], g.size(lo=1)))
        return (a, b), {}

    @staticmethod
    def infer(ts, p):
        floats(ts)
        a, b = ts
        need(a.rank >= 2 and b.rank >= 2 and a.shape[-1] == b.shape[-2], "matmul shapes")
        return [TType(broadcast([a.shape[:-2], b.shape[:-2]]) + (a.shape[-2], b.shape[-1]))]

    @staticmethod
    def render(p, names, ts, tag):
        return [], "jnp.matmul({0}, {1})".format(*names)

    @staticmethod
    def classes(ts, p):
        a, b = ts
        batch = broadcast([a.shape[:-2], b.shape[:-2]])
        ka, kb = bcast_keys([TType(a.shape[:-2]), TType(b.shape[:-2])], batch)
        return Classes([ka + [("m",), ("k",)], kb + [("k",), ("n",)]])


def _parse_einsum(spec):
    ins, out = spec.split("->")
    return ins.split(","), out


@family("einsum", "einsum", 1.5)
class Einsum:
    @staticmethod
    def gen(g):
        a = g.pick(rank=(1, 3), pred=lambda t: 1 <= t.rank <= 3)
        ta = g.types[a]
        la = "ijkl"[:ta.rank]
        size = dict(zip(la, ta.shape))
        lb, fresh = [], iter("pqrs")
        for _ in range(int(g.rng.integers(1, 4))):
            free = [c for c in la if c not in lb]
            if free and g.rng.random() < 0.6:
                lb.append(choice(g.rng, free))
            else:
                c = next(fresh)
                size[c] = g.size(lo=1)
                lb.append(c)
        shared = [c for c in la if c in lb]
        keep = [c for c in shared if g.rng.random() < 0.35]
        out = [c for c in la if c not in lb or c in keep] + [c for c in lb if c not in la]
        if g.rng.random() < 0.15 and len(out) > 1:
            out.pop(int(g.rng.integers(len(out))))        # a dim summed away inside the einsum
        out = list(g.rng.permutation(out)) if out else []
        if len(out) > 4 or math.prod(size[c] for c in out) > 256:
            return None
        b = g.pick(shape=tuple(size[c] for c in lb))
        return (a, b), {"spec": f"{la},{''.join(lb)}->{''.join(out)}"}

    @staticmethod
    def infer(ts, p):
        floats(ts)
        ins, out = _parse_einsum(p["spec"])
        size = {}
        for letters, t in zip(ins, ts):
            need(len(letters) == t.rank, "einsum rank")
            for c, n in zip(letters, t.shape):
                need(size.setdefault(c, n) == n, "einsum sizes")
        return [TType(tuple(size[c] for c in out))]

    @staticmethod
    def render(p, names, ts, tag):
        return [], f"jnp.einsum('{p['spec']}', {names[0]}, {names[1]})"

    @staticmethod
    def classes(ts, p):
        ins, _ = _parse_einsum(p["spec"])
        return Classes([[("e", c) for c in letters] for letters in ins])


@family("dot_general", "dot_general", 1.5)
class DotGeneral:
    @staticmethod
    def gen(g):
        a = g.pick(rank=(1, 3), pred=lambda t: 1 <= t.rank <= 3)
        ta = g.types[a]
        dims = list(g.rng.permutation(ta.rank))
        nc = int(g.rng.integers(0, min(2, len(dims)) + 1))
        ca, dims = dims[:nc], dims[nc:]
        nb = int(g.rng.integers(0, min(1, len(dims)) + 1))
        ba = dims[:nb]
        entries = [("b", i) for i in ba] + [("c", i) for i in ca] + [("f", g.size(lo=1))
                                                                   for _ in range(int(g.rng.integers(0, 3)))]
        entries = [entries[i] for i in g.rng.permutation(len(entries))]
        if not entries:
            return None
        shape = tuple(ta.shape[v] if k != "f" else v for k, v in entries)
        cb = tuple(entries.index(("c", i)) for i in ca)
        bb = tuple(entries.index(("b", i)) for i in ba)
        out = ta.rank - nc + len(entries) - nc - nb
        if out > 4:
            return None
        b = g.pick(shape=shape)
        p = {"c": (tuple(int(i) for i in ca), cb), "b": (tuple(int(i) for i in ba), bb)}
        try:
            t = DotGeneral.infer([ta, g.types[b]], p)[0]
        except Inconsistent:
            return None
        return ((a, b), p) if t.size <= 256 else None

    @staticmethod
    def infer(ts, p):
        floats(ts)
        a, b = ts
        (ca, cb), (ba, bb) = p["c"], p["b"]
        need(all(i < a.rank for i in ca + ba) and all(i < b.rank for i in cb + bb), "dot_general dims")
        need(all(a.shape[i] == b.shape[j] for i, j in zip(ca + ba, cb + bb)), "dot_general sizes")
        free_a = [a.shape[i] for i in range(a.rank) if i not in ca + ba]
        free_b = [b.shape[i] for i in range(b.rank) if i not in cb + bb]
        return [TType(tuple(a.shape[i] for i in ba) + tuple(free_a) + tuple(free_b))]

    @staticmethod
    def render(p, names, ts, tag):
        (ca, cb), (ba, bb) = p["c"], p["b"]
        return [], f"jax.lax.dot_general({names[0]}, {names[1]}, (({tup(ca)}, {tup(cb)}), ({tup(ba)}, {tup(bb)})))"

    @staticmethod
    def classes(ts, p):
        (ca, cb), (ba, bb) = p["c"], p["b"]
        keys = own_keys(ts)
        for k, (i, j) in enumerate(zip(ca, cb)):
            keys[0][i] = keys[1][j] = ("c", k)
        for k, (i, j) in enumerate(zip(ba, bb)):
            keys[0][i] = keys[1][j] = ("bd", k)
        return Classes(keys)


# -- reductions -------------------------------------------------------------------------------------
REDUCE = {"sum": "jnp.sum", "max": "jnp.max", "min": "jnp.min", "mean": "jnp.mean"}


@family("reduce", "reduce", 2.0)
class Reduce:
    @staticmethod
    def gen(g):
        a = g.pick(pred=lambda t: t.rank >= 1, rank=(1, 4))
        r = g.types[a].rank
        if g.rng.random() < 0.15:
            return (a,), {"fn": "argmax", "axes": (int(g.rng.integers(r)),), "keepdims": False}
        k = int(g.rng.integers(1, r + 1))
        axes = tuple(sorted(int(x) for x in g.rng.choice(r, k, replace=False)))
        return (a,), {"fn": choice(g.rng, list(REDUCE)), "axes": axes, "keepdims": bool(g.rng.random() < 0.3)}

    @staticmethod
    def infer(ts, p):
        floats(ts)
        (a,) = ts
        need(all(x < a.rank for x in p["axes"]), "reduce axes")
        shape = tuple(1 if d in p["axes"] else n for d, n in enumerate(a.shape) if p["keepdims"] or d not in p["axes"])
        if p["fn"] == "argmax":
            return [TType(shape, INT, hi=a.shape[p["axes"][0]])]
        return [TType(shape)]

    @staticmethod
    def render(p, names, ts, tag):
        if p["fn"] == "argmax":
            return [], f"jnp.argmax({names[0]}, axis={p['axes'][0]})"
        kd = ", keepdims=True" if p["keepdims"] else ""
        return [], f"{REDUCE[p['fn']]}({names[0]}, axis={tup(p['axes'])}{kd})"

    @staticmethod
    def classes(ts, p):
        keys = own_keys(ts)
        return Classes(keys, {keys[0][p["axes"][0]]} if p["fn"] == "argmax" else set())


# -- shape ops --------------------------------------------------------------------------------------
def _factorizations(n, max_rank=4):
    """Some shapes with n elements, every dim <= 16."""
    out = []

    def rec(rest, dims):
        if rest == 1:
            if dims:
                out.append(tuple(dims))
            return
        if len(dims) == max_rank:
            return
        for d in range(2, min(rest, 16) + 1):
            if rest % d == 0:
                rec(rest // d, dims + [d])
    rec(n, [])
    return out


def _reshape_target(shape, p):
    kind = p["kind"]
    if kind == "merge":
        i, j = p["start"], p["stop"]
        need(0 <= i < j < len(shape), "merge range")
        return shape[:i] + (math.prod(shape[i:j + 1]),) + shape[j + 1:]
    if kind == "split":
        d, f = p["dim"], p["factor"]
        need(d < len(shape) and shape[d] % f == 0, "split factor")
        return shape[:d] + (f, shape[d] // f) + shape[d + 1:]
    if kind == "flatten":
        return (math.prod(shape),)
    if kind == "unsqueeze":
        need(p["dim"] <= len(shape), "unsqueeze dim")
        return shape[:p["dim"]] + (1,) + shape[p["dim"]:]
    if kind == "squeeze":
        need(p["dim"] < len(shape) and shape[p["dim"]] == 1, "squeeze dim")
        return shape[:p["dim"]] + shape[p["dim"] + 1:]
    need(math.prod(p["shape"]) == math.prod(shape), "reshape size")
    return tuple(p["shape"])


def _reshape_groups(ins, outs):
    """Runs of input and output dims with equal products (size-1 dims on their own)."""
    groups, i, j = [], 0, 0
    while i < len(ins) or j < len(outs):
        gi, go, pi, po = [], [], 1, 1
        if i < len(ins):
            gi.append(i)
            pi *= ins[i]
            i += 1
        if j < len(outs):
            go.append(j)
            po *= outs[j]
            j += 1
        while pi != po:
            if pi < po and i < len(ins):
                gi.append(i)
                pi *= ins[i]
                i += 1
            elif j < len(outs):
                go.append(j)
                po *= outs[j]
                j += 1
            else:
                break
        groups.append((gi, go))
    return groups


def _block_length(sizes, splits):
    """Elements in one device's block of these row-major dims, if that block is contiguous."""
    k = next((i for i, (n, s) in enumerate(zip(sizes, splits)) if s != n), len(sizes))
    if any(s != 1 for s in splits[k + 1:]):
        return None
    return math.prod(sizes[k + 1:]) * (sizes[k] // splits[k] if k < len(sizes) else 1)


def _axes_split_major_first(sizes, axes) -> bool:
    """Whether axes of these sizes (major first) split these dims major first, each axis on one dim."""
    k = 0
    for n in sizes:
        used = 1
        while k < len(axes) and n % (used * axes[k]) == 0:
            used *= axes[k]
            k += 1
        if k == len(axes):
            return True
        if used != n:
            return False          # the next axis would straddle this dim and the next
    return k == len(axes)


@family("reshape", "reshape", 3.0)
class Reshape:
    @staticmethod
    def gen(g):
        a = g.pick(pred=lambda t: t.size > 1, rank=(1, 4))
        shape = g.types[a].shape
        kinds = []
        if len(shape) >= 2:
            kinds += ["merge"] * 3
        splittable = [d for d, n in enumerate(shape) if any(n % f == 0 for f in range(2, n))]
        if splittable and len(shape) < 4:
            kinds += ["split"] * 3
        if len(shape) >= 2:
            kinds.append("flatten")
        if len(shape) < 4 and g.has("size1"):
            kinds.append("unsqueeze")
        if 1 in shape:
            kinds.append("squeeze")
        targets = [t for t in _factorizations(math.prod(shape)) if t != shape]
        if targets:
            kinds += ["target"] * 2
        if not kinds:
            return None
        kind = choice(g.rng, kinds)
        if kind == "merge":
            i = int(g.rng.integers(len(shape) - 1))
            p = {"kind": kind, "start": i, "stop": int(g.rng.integers(i + 1, len(shape)))}
        elif kind == "split":
            d = choice(g.rng, splittable)
            p = {"kind": kind, "dim": d, "factor": choice(g.rng, [f for f in range(2, shape[d]) if shape[d] % f == 0])}
        elif kind == "unsqueeze":
            p = {"kind": kind, "dim": int(g.rng.integers(len(shape) + 1))}
        elif kind == "squeeze":
            p = {"kind": kind, "dim": choice(g.rng, [d for d, n in enumerate(shape) if n == 1])}
        elif kind == "target":
            p = {"kind": kind, "shape": choice(g.rng, targets)}
        else:
            p = {"kind": kind}
        return (a,), p

    @staticmethod
    def infer(ts, p):
        return [TType(_reshape_target(ts[0].shape, p), ts[0].dtype, ts[0].hi)]

    @staticmethod
    def render(p, names, ts, tag):
        return [], f"{names[0]}.reshape({tup(_reshape_target(ts[0].shape, p))})"

    @staticmethod
    def mark_check(ts, p, axes):
        """A mark on a reshape's input may be refused where the reshape cannot carry its
        split: within a group of dims that merge or split, the input must be split major-first
        (every more major dim fully split) so local blocks are contiguous, and the mesh axes,
        major to minor, must then split the output dims major-first too (an axis is not cut)."""
        shape = ts[0].shape
        target = _reshape_target(shape, p)
        for gi, go in _reshape_groups(shape, target):
            if len(gi) <= 1 and len(go) <= 1:
                continue
            splits = [math.prod(axes[i]) for i in gi]
            if _block_length([shape[i] for i in gi], splits) is None:
                return "a split the reshape cannot carry without moving data"
            if not _axes_split_major_first([target[j] for j in go], [a for i in gi for a in axes[i]]):
                return "mesh axes the reshape cannot carry onto its output dims"
        return None

    @staticmethod
    def classes(ts, p):
        return Classes(own_keys(ts))


@family("transpose", "transpose", 2.0)
class Transpose:
    @staticmethod
    def gen(g):
        a = g.pick(pred=lambda t: t.rank >= 2, rank=(2, 4))
        r = g.types[a].rank
        perm = tuple(int(x) for x in g.rng.permutation(r))
        if perm == tuple(range(r)):
            perm = perm[1:] + perm[:1]
        return (a,), {"perm": perm}

    @staticmethod
    def infer(ts, p):
        need(sorted(p["perm"]) == list(range(ts[0].rank)), "perm")
        return [TType(tuple(ts[0].shape[i] for i in p["perm"]), ts[0].dtype, ts[0].hi)]

    @staticmethod
    def render(p, names, ts, tag):
        if p["perm"] == (1, 0):
            return [], f"{names[0]}.T"
        return [], f"jnp.transpose({names[0]}, {tup(p['perm'])})"

    @staticmethod
    def classes(ts, p):
        return Classes(own_keys(ts))


@family("slice", "slice", 2.0)
class Slice:
    @staticmethod
    def gen(g):
        a = g.pick(pred=lambda t: any(n >= 2 for n in t.shape), rank=(1, 4))
        shape = g.types[a].shape
        dims = [d for d, n in enumerate(shape) if n >= 2]
        idx = [None] * len(shape)
        for d in g.rng.choice(dims, min(len(dims), int(g.rng.integers(1, 3))), replace=False):
            n = shape[d]
            r = g.rng.random()
            if r < 0.15:
                idx[d] = int(g.rng.integers(n))
            else:
                start = int(g.rng.integers(n - 1))
                stop = int(g.rng.integers(start + 1, n + 1))
                step = 2 if r > 0.85 and stop - start >= 2 else 1
                idx[d] = (start, stop, step)
        if g.rng.random() < 0.2 and all(not isinstance(i, int) for i in idx):
            return (a,), {"dyn": True, "idx": tuple((0, n, 1) if i is None else (i[0], i[1], 1)
                                                   for i, n in zip(idx, shape))}
        return (a,), {"idx": tuple(idx)}

    @staticmethod
    def infer(ts, p):
        shape = ts[0].shape
        need(len(p["idx"]) == len(shape), "slice rank")
        out = []
        for i, n in zip(p["idx"], shape):
            if i is None:
                out.append(n)
            elif isinstance(i, int):
                need(i < n, "slice index")
            else:
                need(i[1] <= n, "slice stop")
                out.append(len(range(*i)))
        return [TType(tuple(out), ts[0].dtype, ts[0].hi)]

    @staticmethod
    def render(p, names, ts, tag):
        if p.get("dyn"):
            starts = tup(i[0] for i in p["idx"])
            sizes = tup(i[1] - i[0] for i in p["idx"])
            return [], f"jax.lax.dynamic_slice({names[0]}, {starts}, {sizes})"
        parts = []
        for i in p["idx"]:
            if i is None:
                parts.append(":")
            elif isinstance(i, int):
                parts.append(str(i))
            else:
                parts.append(f"{i[0] or ''}:{i[1]}" + (f":{i[2]}" if i[2] != 1 else ""))
        while parts and parts[-1] == ":":
            parts.pop()
        return [], f"{names[0]}[{', '.join(parts)}]"

    @staticmethod
    def classes(ts, p):
        keys = own_keys(ts)
        return Classes(keys, {keys[0][d] for d, i in enumerate(p["idx"])
                              if i is not None and (isinstance(i, int) or i[:2] != (0, ts[0].shape[d]) or i[2] != 1)})


@family("take", "take", 1.5)
class Take:
    @staticmethod
    def gen(g):
        a = g.pick(pred=lambda t: t.rank >= 1, rank=(1, 3))
        ta = g.types[a]
        axis = int(g.rng.integers(ta.rank))
        n = ta.shape[axis]
        if g.rng.random() < 0.5:
            const = tuple(int(x) for x in g.rng.integers(0, n, int(g.rng.integers(1, 6))))
            return (a,), {"axis": axis, "const": const}
        shape = (g.size(lo=1),) if g.rng.random() < 0.7 else (g.size(lo=1, hi=4), g.size(lo=1, hi=4))
        if ta.size // n * math.prod(shape) > 256:
            return None
        idx = g.input(TType(shape, INT, hi=n))
        return (a, idx), {"axis": axis, "const": None}

    @staticmethod
    def infer(ts, p):
        a, ax = ts[0], p["axis"]
        need(ax < a.rank, "take axis")
        if p["const"] is not None:
            need(max(p["const"]) < a.shape[ax], "take index")
            idx = (len(p["const"]),)
        else:
            need(ts[1].dtype == INT and ts[1].hi <= a.shape[ax], "take indices")
            idx = ts[1].shape
        return [TType(a.shape[:ax] + idx + a.shape[ax + 1:], a.dtype, a.hi)]

    @staticmethod
    def render(p, names, ts, tag):
        if p["const"] is not None:
            return [], f"jnp.take({names[0]}, jnp.array({list(p['const'])}), axis={p['axis']})"
        if p["axis"] == 0:
            return [], f"{names[0]}[{names[1]}]"
        return [], f"jnp.take({names[0]}, {names[1]}, axis={p['axis']})"

    @staticmethod
    def classes(ts, p):
        keys = own_keys(ts)
        return Classes(keys, {keys[0][p["axis"]]})


class Scatter:
    how = "add"

    @classmethod
    def gen(cls, g):
        a = g.pick(pred=lambda t: t.rank >= 1 and t.shape[0] >= 2, rank=(1, 3))
        ta = g.types[a]
        n = ta.shape[0]
        how = cls.how
        if g.rng.random() < 0.3:
            start = int(g.rng.integers(n - 1))
            stop = int(g.rng.integers(start + 1, n + 1))
            p = {"how": how, "slice": (start, stop), "idx": None}
            k = stop - start
        else:
            k = int(g.rng.integers(1, n + 1))
            idx = g.rng.permutation(n)[:k] if how == "set" else g.rng.integers(0, n, k)  # set: no duplicates
            p = {"how": how, "slice": None, "idx": tuple(int(i) for i in idx)}
        u = g.pick(shape=(k,) + ta.shape[1:])
        return (a, u), p

    @staticmethod
    def infer(ts, p):
        floats(ts)
        a, u = ts
        n = a.shape[0] if a.rank else 0
        if p["slice"] is not None:
            need(p["slice"][1] <= n, "scatter slice")
            k = p["slice"][1] - p["slice"][0]
        else:
            need(max(p["idx"]) < n, "scatter index")
            k = len(p["idx"])
        need(u.shape == (k,) + a.shape[1:], "scatter update shape")
        return [a]

    @staticmethod
    def render(p, names, ts, tag):
        where = f"{p['slice'][0] or ''}:{p['slice'][1]}" if p["slice"] is not None else f"jnp.array({list(p['idx'])})"
        return [], f"{names[0]}.at[{where}].{p['how']}({names[1]})"

    @staticmethod
    def classes(ts, p):
        a, u = ts
        keys = [[("a0",)] + [("s", d) for d in range(1, a.rank)], [("u0",)] + [("s", d) for d in range(1, u.rank)]]
        # a slice update writes u's dim 0 into a's dim 0 (one window dim), and a set (not an add)
        # keeps whole update rows: u's dim 0 is needed whole too; an indexed add may split it
        whole = {("a0",), ("u0",)} if p["slice"] is not None or p["how"] == "set" else {("a0",)}
        return Classes(keys, whole)


family("scatter", "scatter", 1.0)(type("ScatterAdd", (Scatter,), {"how": "add"}))
family("scatter_set", "scatter_set", 1.0)(type("ScatterSet", (Scatter,), {"how": "set"}))


CUMULATIVE = {"cumsum": "jnp.cumsum({0}, axis={axis})", "cummax": "jax.lax.cummax({0}, axis={axis})",
              "rcumsum": "jax.lax.cumsum({0}, axis={axis}, reverse=True)",
              "cumprod": "jnp.cumprod({0}, axis={axis})"}


@family("cumsum", "cumsum", 1.5)
class Cumulative:
    @staticmethod
    def gen(g):
        a = g.pick(pred=lambda t: t.rank >= 1, rank=(1, 3))
        return (a,), {"fn": choice(g.rng, list(CUMULATIVE)), "axis": int(g.rng.integers(g.types[a].rank))}

    @staticmethod
    def infer(ts, p):
        floats(ts)
        need(p["axis"] < ts[0].rank, "cumulative axis")
        return [ts[0]]

    @staticmethod
    def render(p, names, ts, tag):
        return [], CUMULATIVE[p["fn"]].format(names[0], axis=p["axis"])

    @staticmethod
    def classes(ts, p):
        keys = own_keys(ts)
        return Classes(keys, {keys[0][p["axis"]]})


@family("softmax", "softmax", 1.5)
class Softmax:
    @staticmethod
    def gen(g):
        a = g.pick(pred=lambda t: t.rank >= 1, rank=(1, 4))
        r = g.types[a].rank
        return (a,), {"fn": choice(g.rng, ["softmax", "log_softmax"]),
                      "axis": -1 if g.rng.random() < 0.6 else int(g.rng.integers(r))}

    @staticmethod
    def infer(ts, p):
        floats(ts)
        need(ts[0].rank >= 1 and p["axis"] < ts[0].rank, "softmax axis")
        return [ts[0]]

    @staticmethod
    def render(p, names, ts, tag):
        return [], f"jax.nn.{p['fn']}({names[0]}, axis={p['axis']})"

    @staticmethod
    def classes(ts, p):
        return Classes(own_keys(ts))


@family("layernorm", "layernorm", 1.0)
class LayerNorm:
    @staticmethod
    def gen(g):
        a = g.pick(pred=lambda t: t.rank >= 1 and t.shape[-1] >= 2, rank=(1, 3))
        gamma = g.pick(shape=(g.types[a].shape[-1],))
        return (a, gamma), {}

    @staticmethod
    def infer(ts, p):
        floats(ts)
        a, w = ts
        need(a.rank >= 1 and w.shape == a.shape[-1:], "layer norm scale")
        return [a]

    @staticmethod
    def render(p, names, ts, tag):
        a, w = names
        return [], (f"({a} - {a}.mean(-1, keepdims=True)) * jax.lax.rsqrt({a}.var(-1, keepdims=True) + 1e-5)"
                    f" * {w}")

    @staticmethod
    def classes(ts, p):
        keys = own_keys(ts)
        keys[1][0] = keys[0][-1]
        return Classes(keys)


class Concat:
    stack = False

    @classmethod
    def gen(cls, g):
        a = g.pick(pred=lambda t: t.rank >= 1, rank=(1, 3))
        shape = g.types[a].shape
        stack = cls.stack
        axis = int(g.rng.integers(len(shape) + (1 if stack else 0)))
        args = [a]
        for _ in range(int(g.rng.integers(1, 3))):
            if stack:
                args.append(g.pick(shape=shape))
            else:
                s = list(shape)
                s[axis] = g.size(lo=1)
                args.append(g.pick(shape=tuple(s)))
        return tuple(args), {"axis": axis, "stack": stack}

    @staticmethod
    def infer(ts, p):
        floats(ts)
        ax, first = p["axis"], ts[0].shape
        if p["stack"]:
            need(all(t.shape == first for t in ts) and ax <= len(first), "stack shapes")
            return [TType(first[:ax] + (len(ts),) + first[ax:])]
        need(ax < len(first), "concat axis")
        need(all(t.rank == len(first) and t.shape[:ax] + t.shape[ax + 1:] == first[:ax] + first[ax + 1:]
                 for t in ts), "concat shapes")
        return [TType(first[:ax] + (sum(t.shape[ax] for t in ts),) + first[ax + 1:])]

    @staticmethod
    def render(p, names, ts, tag):
        fn = "stack" if p["stack"] else "concatenate"
        return [], f"jnp.{fn}([{', '.join(names)}], axis={p['axis']})"

    @staticmethod
    def classes(ts, p):
        keys = [[("d", d) for d in range(t.rank)] for t in ts]
        if p["stack"]:
            return Classes(keys)
        for i in range(len(ts)):
            keys[i][p["axis"]] = ("cat", i)
        return Classes(keys, {("cat", i) for i in range(len(ts))})


family("concat", "concat", 1.5)(Concat)
family("stack", "stack", 0.7)(type("Stack", (Concat,), {"stack": True}))


@family("pad", "pad", 1.0)
class Pad:
    @staticmethod
    def gen(g):
        a = g.pick(pred=lambda t: t.rank >= 1, rank=(1, 3))
        r = g.types[a].rank
        widths = [(0, 0, 0)] * r
        interior = g.rng.random() < 0.25
        for d in g.rng.choice(r, min(r, int(g.rng.integers(1, 3))), replace=False):
            widths[d] = (int(g.rng.integers(0, 3)), int(g.rng.integers(1, 3)), int(interior))
        return (a,), {"widths": tuple(widths)}

    @staticmethod
    def infer(ts, p):
        floats(ts)
        need(len(p["widths"]) == ts[0].rank, "pad rank")
        return [TType(tuple(n + lo + hi + max(n - 1, 0) * it for n, (lo, hi, it) in zip(ts[0].shape, p["widths"])))]

    @staticmethod
    def render(p, names, ts, tag):
        if any(it for _, _, it in p["widths"]):
            return [], f"jax.lax.pad({names[0]}, 0.0, {tup(tup(w) for w in p['widths'])})"
        return [], f"jnp.pad({names[0]}, {tup(tup(w[:2]) for w in p['widths'])})"

    @staticmethod
    def classes(ts, p):
        keys = own_keys(ts)
        return Classes(keys, {keys[0][d] for d, w in enumerate(p["widths"]) if any(w)})


@family("sort", "sort", 1.0)
class Sort:
    @staticmethod
    def gen(g):
        a = g.pick(pred=lambda t: t.rank >= 1, rank=(1, 3))
        return (a,), {"axis": int(g.rng.integers(g.types[a].rank)), "arg": bool(g.rng.random() < 0.3)}

    @staticmethod
    def infer(ts, p):
        floats(ts)
        need(p["axis"] < ts[0].rank, "sort axis")
        if p["arg"]:
            return [TType(ts[0].shape, INT, hi=ts[0].shape[p["axis"]])]
        return [ts[0]]

    @staticmethod
    def render(p, names, ts, tag):
        return [], f"jnp.{'argsort' if p['arg'] else 'sort'}({names[0]}, axis={p['axis']})"

    @staticmethod
    def classes(ts, p):
        keys = own_keys(ts)
        return Classes(keys, {keys[0][p["axis"]]})


@family("topk", "topk", 1.0)
class TopK:
    @staticmethod
    def gen(g):
        a = g.pick(pred=lambda t: t.rank >= 1, rank=(1, 3))
        return (a,), {"k": int(g.rng.integers(1, g.types[a].shape[-1] + 1))}

    @staticmethod
    def infer(ts, p):
        floats(ts)
        a = ts[0]
        need(a.rank >= 1 and p["k"] <= a.shape[-1], "top_k k")
        shape = a.shape[:-1] + (p["k"],)
        return [TType(shape), TType(shape, INT, hi=a.shape[-1])]

    @staticmethod
    def render(p, names, ts, tag):
        return [], f"jax.lax.top_k({names[0]}, {p['k']})"

    @staticmethod
    def classes(ts, p):
        keys = own_keys(ts)
        return Classes(keys, {keys[0][-1]})


# -- windows ----------------------------------------------------------------------------------------
@family("conv", "conv", 1.0)
class Conv:
    @staticmethod
    def gen(g):
        nd = 2 if g.rng.random() < 0.6 else 1
        x = g.pick(rank=(nd + 2, nd + 2), pred=lambda t: t.rank == nd + 2 and t.shape[1] <= 4
                   and min(t.shape[2:]) >= 2,
                   make=lambda: (g.size(lo=1, hi=4), choice(g.rng, [1, 2, 3]))
                   + tuple(choice(g.rng, [3, 4, 5, 8]) for _ in range(nd)))
        tx = g.types[x]
        kernel = tuple(int(g.rng.integers(1, min(3, n) + 1)) for n in tx.shape[2:])
        w = g.pick(shape=(choice(g.rng, [1, 2, 4]), tx.shape[1]) + kernel)
        p = {"strides": tuple(choice(g.rng, [1, 1, 2]) for _ in range(nd)),
             "padding": choice(g.rng, ["SAME", "VALID"])}
        t = Conv.infer([tx, g.types[w]], p)[0]
        return ((x, w), p) if t.size <= 512 else None

    @staticmethod
    def infer(ts, p):
        floats(ts)
        x, w = ts
        nd = len(p["strides"])
        need(x.rank == w.rank == nd + 2 and x.shape[1] == w.shape[1], "conv shapes")
        out = []
        for n, k, s in zip(x.shape[2:], w.shape[2:], p["strides"]):
            m = -(-n // s) if p["padding"] == "SAME" else (n - k) // s + 1
            need(m >= 1, "conv output size")
            out.append(m)
        return [TType((x.shape[0], w.shape[0]) + tuple(out))]

    @staticmethod
    def render(p, names, ts, tag):
        return [], f"jax.lax.conv_general_dilated({names[0]}, {names[1]}, {tup(p['strides'])}, '{p['padding']}')"

    @staticmethod
    def classes(ts, p):
        x, w = ts
        keys = [[("n",), ("c",)] + [("xs", d) for d in range(2, x.rank)],
                [("o",), ("c",)] + [("ws", d) for d in range(2, w.rank)]]
        return Classes(keys, set(keys[0][2:]) | set(keys[1][2:]))


POOL_INIT = {"max": ("-jnp.inf", "jax.lax.max"), "sum": ("0.0", "jax.lax.add"), "avg": ("0.0", "jax.lax.add")}


@family("pool", "pool", 1.0)
class Pool:
    @staticmethod
    def gen(g):
        a = g.pick(pred=lambda t: t.rank >= 1 and max(t.shape) >= 2, rank=(1, 4))
        shape = g.types[a].shape
        window, strides = [1] * len(shape), [1] * len(shape)
        dims = [d for d, n in enumerate(shape) if n >= 2]
        for d in g.rng.choice(dims, min(len(dims), int(g.rng.integers(1, 3))), replace=False):
            window[d] = int(g.rng.integers(2, min(3, shape[d]) + 1))
            strides[d] = choice(g.rng, [1, window[d]])
        return (a,), {"fn": choice(g.rng, list(POOL_INIT)), "window": tuple(window), "strides": tuple(strides)}

    @staticmethod
    def infer(ts, p):
        floats(ts)
        need(len(p["window"]) == ts[0].rank, "pool rank")
        out = tuple((n - w) // s + 1 for n, w, s in zip(ts[0].shape, p["window"], p["strides"]))
        need(all(m >= 1 for m in out), "pool window")
        return [TType(out)]

    @staticmethod
    def render(p, names, ts, tag):
        init, op = POOL_INIT[p["fn"]]
        e = f"jax.lax.reduce_window({names[0]}, {init}, {op}, {tup(p['window'])}, {tup(p['strides'])}, 'VALID')"
        return [], e + (f" / {math.prod(p['window'])}.0" if p["fn"] == "avg" else "")

    @staticmethod
    def classes(ts, p):
        keys = own_keys(ts)
        return Classes(keys, {keys[0][d] for d, (w, s) in enumerate(zip(p["window"], p["strides"])) if w > 1 or s > 1})


# -- control flow -----------------------------------------------------------------------------------
def strategy_text(s) -> str:
    from .render import strategy_text as st
    return st(s)


SCAN_BODY = {"tanh": "jnp.tanh(c * 0.9 + x)", "mix": "c * 0.5 + jax.nn.relu(x)", "mul": "c * jnp.tanh(x) + x"}


@family("scan", "scan", 1.5)
class Scan:
    @staticmethod
    def gen(g):
        c = g.pick(rank=(0, 3), pred=lambda t: t.rank <= 3)
        ct = g.types[c]
        steps = choice(g.rng, [2, 3, 4, 5])
        noxs = g.rng.random() < 0.15
        ys = "x" if noxs else choice(g.rng, ["carry", "carry", "x"])
        if g.has("scan_float") and g.rng.random() < 0.3:
            ys = "float"
        p = {"body": choice(g.rng, list(SCAN_BODY)), "ys": ys, "reverse": bool(g.rng.random() < 0.2),
             "length": steps if noxs else None, "inner": None}
        if g.has("marks") and g.rng.random() < 0.3 and ct.rank >= 1:
            p["inner"] = g.valid_strategy(ct.shape)
        if noxs:
            return (c,), p
        xs = g.pick(shape=(steps,) + ct.shape)
        return (c, xs), p

    @staticmethod
    def infer(ts, p):
        floats(ts)
        c = ts[0]
        if p["length"] is None:
            need(len(ts) == 2 and ts[1].shape[1:] == c.shape and ts[1].rank >= 1, "scan xs shape")
            steps = ts[1].shape[0]
        else:
            need(len(ts) == 1, "scan without xs")
            steps = p["length"]
        if p["inner"] is not None:
            need(len(p["inner"][1]) <= c.rank, "inner mark rank")
        ys = (steps,) if p["ys"] == "float" else (steps,) + c.shape
        return [c, TType(ys)]

    @staticmethod
    def render(p, names, ts, tag):
        body = SCAN_BODY[p["body"]] if p["length"] is None else "jnp.tanh(c * 0.9) + 0.1"
        if p["inner"] is not None:
            body = f"sp.shard(jnp.tanh, ({strategy_text(p['inner'])},))({body})"
        ys = {"carry": "c * 2.0", "x": "x - c" if p["length"] is None else "c - 1.0", "float": "0.0"}[p["ys"]]
        lines = [f"def body{tag}(c, x):", f"    c = {body}", f"    return c, {ys}"]
        rev = ", reverse=True" if p["reverse"] else ""
        if p["length"] is not None:
            return lines, f"jax.lax.scan(body{tag}, {names[0]}, None, length={p['length']}{rev})"
        return lines, f"jax.lax.scan(body{tag}, {names[0]}, {names[1]}{rev})"

    @staticmethod
    def classes(ts, p):
        c = ts[0]
        keys = [[("c", d) for d in range(c.rank)]]
        if len(ts) == 2:
            keys.append([("t",)] + [("c", d) for d in range(c.rank)])
        return Classes(keys, {("t",)})


def _scan_inner(p, ts):
    return [(p["inner"], ts[0].shape)] if p["inner"] is not None else []


FAMILIES["scan"].inner = _scan_inner


@family("loop", "while", 1.0)
class Loop:
    @staticmethod
    def gen(g):
        a = g.pick(rank=(0, 3))
        b = g.pick(shape=g.types[a].shape)
        kind = "while" if g.wrapper == "fwd" and g.rng.random() < 0.6 else "fori"
        return (a, b), {"kind": kind, "n": choice(g.rng, [1, 2, 3])}

    @staticmethod
    def infer(ts, p):
        floats(ts)
        need(ts[0].shape == ts[1].shape, "loop carries")
        return [ts[0]]

    @staticmethod
    def render(p, names, ts, tag):
        if p["kind"] == "while":
            lines = [f"def cond{tag}(s):", f"    return s[0] < {p['n']}",
                     f"def body{tag}(s):", "    return s[0] + 1, jnp.tanh(s[1]) * 1.5 + s[2], s[2]"]
            return lines, f"jax.lax.while_loop(cond{tag}, body{tag}, (0, {names[0]}, {names[1]}))[1]"
        lines = [f"def body{tag}(i, s):", "    return jnp.tanh(s[0]) + s[1] * 0.5, s[1]"]
        return lines, f"jax.lax.fori_loop(0, {p['n']}, body{tag}, ({names[0]}, {names[1]}))[0]"

    @staticmethod
    def classes(ts, p):
        return Classes([[("d", d) for d in range(t.rank)] for t in ts])


@family("cond", "cond", 1.0)
class Cond:
    @staticmethod
    def gen(g):
        a = g.pick(rank=(0, 3))
        b = g.pick(shape=g.types[a].shape)
        pred = g.pick_input_float()        # an input, so the branch taken is exact on every device
        return (a, b, pred), {"yes": choice(g.rng, ["a * b", "a + jnp.tanh(b)"]),
                              "no": choice(g.rng, ["a - b", "jax.nn.relu(a) * 2.0"])}

    @staticmethod
    def infer(ts, p):
        floats(ts)
        need(ts[0].shape == ts[1].shape, "cond operands")
        return [ts[0]]

    @staticmethod
    def render(p, names, ts, tag):
        lines = [f"def yes{tag}(a, b):", f"    return {p['yes']}", f"def no{tag}(a, b):", f"    return {p['no']}"]
        return lines, f"jax.lax.cond({names[2]}.reshape(-1)[0] > 0, yes{tag}, no{tag}, {names[0]}, {names[1]})"

    @staticmethod
    def classes(ts, p):
        keys = [[("d", d) for d in range(t.rank)] for t in ts[:2]] + [[("p", d) for d in range(ts[2].rank)]]
        return Classes(keys, set(keys[2]))      # the predicate reads one element (a slice)


# -- random numbers ---------------------------------------------------------------------------------
RANDOM = {"dropout": "jnp.where(jax.random.bernoulli({k}, 0.75, {a}.shape), {a} / 0.75, 0.0)",
          "normal": "{a} + 0.1 * jax.random.normal({k}, {a}.shape)",
          "uniform": "{a} * jax.random.uniform({k}, {a}.shape)"}
KEYOPS = {"none": "{k}", "fold": "jax.random.fold_in({k}, 3)", "split": "jax.random.split({k})[1]"}


@family("random", "random", 1.5)
class Random:
    @staticmethod
    def gen(g):
        a = g.pick(rank=(0, 4))
        p = {"kind": choice(g.rng, list(RANDOM)), "keyop": choice(g.rng, ["none", "none", "fold", "split"])}
        if g.rng.random() < 0.15:
            return (a,), dict(p, internal=True)
        dtype = KEY if g.rng.random() < 0.6 else RAWKEY
        keys = [n for n, t in g.inputs.items() if t.dtype == dtype]
        k = keys[0] if keys and g.rng.random() < 0.5 else g.input(TType(() if dtype == KEY else (2,), dtype))
        return (a, k), dict(p, internal=False)

    @staticmethod
    def infer(ts, p):
        need(ts[0].dtype == FLOAT, "random operand")
        if not p["internal"]:
            need(len(ts) == 2 and ts[1].dtype in (KEY, RAWKEY), "random key")
        return [ts[0]]

    @staticmethod
    def render(p, names, ts, tag):
        k = "jax.random.key(7)" if p["internal"] else names[1]
        return [], RANDOM[p["kind"]].format(a=names[0], k=KEYOPS[p["keyop"]].format(k=k))

    @staticmethod
    def classes(ts, p):
        keys = own_keys(ts)
        return Classes(keys, one={k for row in keys[1:] for k in row})
