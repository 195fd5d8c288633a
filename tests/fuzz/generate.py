"""Drawing a program from (seed, index): numpy's Generator, nothing else, so the
same pair always gives the same program."""
from __future__ import annotations

import math

import numpy as np

from . import strategies as S
from .ops import FAMILIES, Classes, choice
from .program import FLOAT, KEY, RAWKEY, Inconsistent, Instr, Mark, Program, TType, infer

SIZES = (1, 2, 3, 4, 5, 7, 8, 16)
SIZE_WEIGHTS = (0.07, 0.2, 0.09, 0.2, 0.06, 0.06, 0.22, 0.1)
MESHES = {8: 8, 4: 4, "dp_mp": ((2, 4), ("dp", "mp")), "abc": ((2, 2, 2), ("a", "b", "c"))}
MODES = ("sharding_propagation", "semi_auto", "data_parallel", "auto")
AUTO_SHARE = 0.25   # of the programs drawn in sharding_propagation or semi_auto mode
# of the mode="auto" programs, those searched under a memory limit: a share of the free
# plan's modeled peak (issue 27's limits), drawn apart like the mode
MEMORY_SHARE = 0.5
MEMORY_LIMITS = (0.5, 0.7, 0.9)

# Features: the op families' names, plus these switches of the generator.
SWITCHES = ("broadcast", "size1", "scan_float", "marks", "mark_out", "in_out", "named_mesh", "mesh4",
            "semi_auto", "data_parallel", "auto", "memory", "grad", "train", "invalid", "unused")
FEATURES = tuple(sorted({f.feature for f in FAMILIES.values()} | set(SWITCHES)))
MAX_ELEMS = 256


class Gen:
    """The state a family's ``gen`` sees: the pool of values and how to draw more."""

    def __init__(self, rng, features, mesh, wrapper):
        self.rng, self.features, self.mesh, self.wrapper = rng, set(features), mesh, wrapper
        self.inputs: dict = {}
        self.types: dict = {}
        self.instrs: list = []
        self.batch = None

    def has(self, feature) -> bool:
        return feature in self.features

    def size(self, lo=1, hi=16) -> int:
        opts = [(s, w) for s, w in zip(SIZES, SIZE_WEIGHTS) if lo <= s <= hi and (s > 1 or self.has("size1"))]
        if not opts:
            return max(lo, 2)
        sizes, w = zip(*opts)
        return int(self.rng.choice(sizes, p=np.array(w) / sum(w)))

    def rand_shape(self, rank=(0, 4)) -> tuple:
        r = int(self.rng.choice(np.arange(rank[0], rank[1] + 1),
                                p=_norm([(0.6, 2, 3, 2.5, 1.2)[k] for k in range(rank[0], rank[1] + 1)])))
        for _ in range(20):
            shape = tuple(self.size() for _ in range(r))
            if math.prod(shape) <= MAX_ELEMS:
                return shape
        return (2,) * r

    def broadcast_shape(self, shape) -> tuple:
        """A shape that broadcasts against ``shape``: a suffix, some dims set to 1."""
        suffix = shape[int(self.rng.integers(len(shape) + 1)):]
        if self.has("size1"):
            suffix = tuple(1 if self.rng.random() < 0.3 else n for n in suffix)
        return suffix

    def input(self, t: TType) -> str:
        name = f"x{len(self.inputs)}"
        self.inputs[name] = self.types[name] = t
        return name

    def pick(self, pred=None, rank=(0, 4), shape=None, make=None, dtype=FLOAT) -> str:
        """A value from the pool (recent ones first) or a new input."""
        def fits(t):
            if t.dtype != dtype:
                return False
            if shape is not None:
                return t.shape == tuple(shape)
            return rank[0] <= t.rank <= rank[1] and (pred is None or pred(t))
        cands = [n for n, t in self.types.items() if fits(t)]
        if cands and self.rng.random() < 0.8:
            w = np.array([2.0 ** min(i, 6) for i in range(len(cands))])   # later values weigh more
            return cands[int(self.rng.choice(len(cands), p=w / w.sum()))]
        if shape is not None:
            return self.input(TType(tuple(shape), dtype))
        for _ in range(30):
            s = make() if make else self.rand_shape(rank)
            if fits(TType(s, dtype)):
                return self.input(TType(s, dtype))
        raise _Retry()

    def pick_input_float(self) -> str:
        names = [n for n, t in self.inputs.items() if t.dtype == FLOAT]
        if names and self.rng.random() < 0.7:
            return choice(self.rng, names)
        return self.input(TType(self.rand_shape((0, 2))))

    def valid_strategy(self, shape) -> tuple:
        return S.valid_tensor_strategy(self.rng, shape, self.mesh)


class _Retry(Exception):
    pass


def _norm(w):
    w = np.array(w, float)
    return w / w.sum()


def _pick_weighted(rng, options: dict):
    keys = list(options)
    return keys[int(rng.choice(len(keys), p=_norm([options[k] for k in keys])))]


def generate(seed: int, index: int, features=FEATURES) -> Program:
    rng = np.random.default_rng([seed, index])
    f = set(features)
    meshes = {8: 4.0}
    if "mesh4" in f:
        meshes[4] = 1.5
    if "named_mesh" in f:
        meshes.update(dp_mp=2.5, abc=2.0)
    mesh = MESHES[_pick_weighted(rng, meshes)]
    modes = {"sharding_propagation": 6.0}
    if "semi_auto" in f:
        modes["semi_auto"] = 2.5
    if "data_parallel" in f:
        modes["data_parallel"] = 1.5
    mode = _pick_weighted(rng, modes)
    wrappers = {"fwd": 5.5}
    if "grad" in f:
        wrappers["grad"] = 3.0
    if "train" in f:
        wrappers.update(sgd=0.8, adam=0.7)
    wrapper = _pick_weighted(rng, wrappers)
    g = Gen(rng, f, mesh, wrapper)
    n = mesh if isinstance(mesh, int) else math.prod(mesh[0])
    if mode == "data_parallel":
        dim0 = choice(rng, [s for s in (n, 2 * n) if s <= 16])
        rest = g.rand_shape((0, 2))
        while dim0 * math.prod(rest) > MAX_ELEMS:
            rest = rest[1:]
        g.batch = g.input(TType((dim0,) + rest))
    else:
        g.input(TType(g.rand_shape((1, 3))))
    fams = {k: fam.weight for k, fam in FAMILIES.items() if fam.feature in f and (fam.grad_ok or wrapper == "fwd")}
    if not fams:
        fams = {"unary": 1.0}
    for _ in range(int(rng.integers(2, 13))):
        _emit(g, rng, fams)
    if "auto" in f and mode != "data_parallel" and np.random.default_rng([seed, index, 1]).random() < AUTO_SHARE:
        # mode="auto" keeps the marks and in/out strategies as constraints and searches the
        # rest: the same program, planned by the search (drawn apart, so a seed's programs
        # are the ones it drew before this mode)
        mode = "auto"
    program = _finish(g, rng, seed, index, mode)
    drawn = np.random.default_rng([seed, index, 2])
    if mode == "auto" and "memory" in f and drawn.random() < MEMORY_SHARE:
        program.memory_share = float(drawn.choice(MEMORY_LIMITS))
    if "invalid" in f and rng.random() < 0.1:
        _plant(g, rng, program, fams)
    return program


def _emit(g: Gen, rng, fams, unused=False):
    for _ in range(8):
        name = _pick_weighted(rng, fams)
        fam = FAMILIES[name]
        saved = (dict(g.inputs), dict(g.types))
        try:
            got = fam.gen(g)
            if got is None:
                raise _Retry()
            args, params = got
            outs_t = fam.infer([g.types[a] for a in args], params)
            if any(t.size > 4 * MAX_ELEMS for t in outs_t):
                raise _Retry()
        except (_Retry, Inconsistent):
            g.inputs, g.types = saved
            continue
        k = len(g.instrs)
        outs = tuple(f"v{k}" if len(outs_t) == 1 else f"v{k}_{j}" for j in range(len(outs_t)))
        ins = Instr(name, tuple(args), params, outs, unused=unused)
        g.instrs.append(ins)
        g.types.update(zip(outs, outs_t))
        return ins
    return None


def _finish(g: Gen, rng, seed, index, mode) -> Program:
    used = {a for ins in g.instrs for a in ins.args}
    outputs = [o for ins in g.instrs for o in ins.outs if o not in used]
    for ins in g.instrs:
        for o in ins.outs:
            if o in used and rng.random() < 0.1:
                outputs.append(o)          # an intermediate value returned too
    if not outputs:
        outputs = [g.instrs[-1].outs[0]] if g.instrs else [next(iter(g.inputs))]
    inputs = dict(g.inputs)
    if g.batch is not None:                 # the batch argument goes last (data_parallel splits the last one)
        inputs[g.batch] = inputs.pop(g.batch)
    wrapper = g.wrapper
    floats_out = [o for o in outputs if g.types[o].dtype == FLOAT]
    if wrapper != "fwd" and not floats_out:
        wrapper = "fwd"
    params = ()
    if wrapper in ("sgd", "adam"):
        cands = [n for n, t in inputs.items() if t.dtype == FLOAT and n != g.batch]
        params = tuple(n for n in cands if rng.random() < 0.7) or tuple(cands[:1])
        if not params:
            wrapper = "grad"
    p = Program(seed, index, inputs, list(g.instrs), tuple(outputs), g.mesh, mode, wrapper=wrapper,
                params=params)
    types = dict(g.types)
    if "marks" in g.features:
        k = int(rng.choice(4, p=[0.25, 0.3, 0.25, 0.2]))
        for i in rng.permutation(len(p.instrs))[:k]:
            ins = p.instrs[int(i)]
            ins.mark = Mark(S.valid_mark(rng, ins, types, p.mesh))
            if "mark_out" in g.features and rng.random() < 0.15:
                ins.mark.outs = tuple(S.valid_tensor_strategy(rng, types[o].shape, p.mesh) for o in ins.outs)
    if "in_out" in g.features and wrapper in ("fwd", "grad") and mode != "data_parallel":
        if rng.random() < 0.3:
            for name, t in inputs.items():
                # rank 0 gets () or P() too: parallelize reads () at an array as its strategy
                if t.dtype not in (KEY, RAWKEY) and rng.random() < 0.5:
                    p.in_strategy[name] = S.valid_tensor_strategy(rng, t.shape, p.mesh)
        if wrapper == "fwd" and rng.random() < 0.2:
            p.out_strategy = tuple(S.valid_tensor_strategy(rng, types[o].shape, p.mesh)
                                   if rng.random() < 0.6 else None for o in p.outputs)
    return p


def _plant(g: Gen, rng, p: Program, fams) -> None:
    """Make one strategy invalid on purpose, on a mark (maybe of a call whose result is
    unused) or on parallelize's own in/out strategies."""
    where = ["mark"] * 4
    if "in_out" in g.features and p.wrapper in ("fwd", "grad") and p.mode != "data_parallel":
        where += ["in", "in_structure"]
        if p.wrapper == "fwd":
            where += ["out", "out_structure"]
    for _ in range(10):
        at = choice(rng, where)
        kind = choice(rng, S.INVALID_KINDS)
        q = p.copy()
        if at == "in_structure":
            q.bad_in_structure, q.planted = True, "in_structure"
        elif at == "out_structure":
            q.bad_out_structure, q.planted = True, "out_structure"
        elif at in ("in", "out"):
            names = [n for n, t in q.inputs.items() if t.dtype not in (KEY, RAWKEY)] if at == "in" else list(q.outputs)
            if not names:
                continue
            name = choice(rng, names)
            s = S.invalid_tensor(rng, kind, g.types[name].shape, q.mesh)
            if s is None:
                continue
            if at == "in":
                q.in_strategy[name] = s
            else:
                outs = list(q.out_strategy or (None,) * len(q.outputs))
                outs[q.outputs.index(name)] = s
                q.out_strategy = tuple(outs)
            q.planted = f"parallelize {at}_strategy: {kind}"
        else:
            ins = _mark_target(g, rng, q, fams)
            if ins is None or not _plant_mark(rng, ins, kind, g.types, q.mesh):
                continue
            q.planted = f"mark on {ins.op}: {kind}" + (" (result unused)" if ins.unused else "")
        try:
            if S.expect(q).status == S.INVALID:
                p.__dict__.update(q.__dict__)
                return
        except Exception:
            continue


def _mark_target(g, rng, q: Program, fams):
    if "unused" in g.features and rng.random() < 0.35:
        before = len(g.instrs)
        ins = _emit(g, rng, fams, unused=True)
        if ins is None:
            return None
        q.instrs.append(ins)
        q.inputs.update({k: v for k, v in g.inputs.items() if k not in q.inputs})
        if g.batch is not None:
            q.inputs[g.batch] = q.inputs.pop(g.batch)
        del g.instrs[before:]
        ins.mark = Mark(S.valid_mark(rng, ins, g.types, q.mesh))
        return ins
    i = int(rng.integers(len(q.instrs)))
    ins = q.instrs[i]
    if ins.mark is None:
        ins.mark = Mark(S.valid_mark(rng, ins, g.types, q.mesh))
    else:
        ins.mark = Mark(ins.mark.ins, ins.mark.outs)
    return ins


def _plant_mark(rng, ins: Instr, kind: str, types, mesh) -> bool:
    ts = [types[a] for a in ins.args]
    m = ins.mark
    if kind == "out_entries":
        outs = [S.valid_tensor_strategy(rng, types[o].shape, mesh) for o in ins.outs]
        m.outs = tuple(outs + outs[:1]) if rng.random() < 0.5 or len(outs) < 2 else tuple(outs[1:])
        return True
    if kind == "entries" and rng.random() < 0.5:
        m.ins = m.ins[:-1] if len(m.ins) > 1 and rng.random() < 0.5 else m.ins + m.ins[:1]
        return True
    if kind == "mismatch":
        cl: Classes = FAMILIES[ins.op].classes(ts, ins.params)
        spots: dict = {}
        for i, row in enumerate(cl.keys):
            for d, k in enumerate(row):
                spots.setdefault(k, []).append((i, d))
        shared = [v for k, v in spots.items() if len(v) >= 2 and ts[v[0][0]].shape[v[0][1]] % 2 == 0
                  and k not in cl.one]
        if not shared:
            return False
        (i, d) = choice(rng, shared)[1]
        entries = list(m.ins)
        kind_, body = entries[i]
        body = list(body) + [None] * (ts[i].rank - len(body)) if kind_ == "p" else list(body)
        if kind_ == "s":
            body[d] = 1 if body[d] != 1 else 2
        else:
            body[d] = None if body[d] is not None else mesh[1][0]
        entries[i] = (kind_, tuple(body))
        m.ins = tuple(entries)
        return True
    order = rng.permutation(len(ts))
    for i in order:
        s = S.invalid_tensor(rng, kind, ts[i].shape, mesh)
        if s is not None and ts[i].dtype not in (KEY, RAWKEY):
            entries = list(m.ins)
            entries[i] = s
            m.ins = tuple(entries)
            return True
    return False
