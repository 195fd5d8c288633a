"""The differential fuzzer (tests/fuzz): a quick budget on fixed seeds, and
tests of the fuzzer itself (deterministic, its shrinker shrinks, each outcome
class is reachable, its judge of strategies agrees with the generator).

The long run, on a rotating seed (docs/guide/correctness.md), is not part of the CI:

    python -m tests.fuzz --n 10000 --seed "$(date +%Y%m%d)" --jobs 2
"""
import os

import jax
import numpy as np
import pytest

import shardprop as sp
from tests.fuzz.generate import FEATURES, MODES, generate
from tests.fuzz.oracle import CLASSES, compare, message_problems, run_program
from tests.fuzz.program import Instr, Mark, Program, TType
from tests.fuzz.render import render
from tests.fuzz.runner import run_many
from tests.fuzz.shrink import candidates, shrink, size_of
from tests.fuzz.strategies import INVALID, MAY_REJECT, VALID, expect

# Every test here is marked fuzz (and so slow): the budget runs programs end to end, and the
# fuzzer's own tests generate hundreds of programs.
pytestmark = pytest.mark.fuzz

# The CI's budget: QUICK_N programs on each of fixed seeds, so the run changes only when the
# code does (a program is a pure function of its seed and index). Exploring new programs is the
# rotating-seed run above; SHARDPROP_FUZZ_SEED=S runs this budget on seed S instead.
CI_SEEDS = (1, 2, 3, 4)
QUICK_N = 10

# Features the CI run leaves out while the bug they hit is open (issue 11), each with the
# bug it waits for, e.g. "stack": "jnp.stack binds 'stack', which has no rule". Re-enable one
# as its fix lands; `python -m tests.fuzz --features <name>,elementwise` checks it alone.
# Empty since 3d36b81: stack, scatter_set, mark_out and invalid were fixed in fd4ce90/3d36b81.
WAITING: dict = {}
CI_FEATURES = tuple(f for f in FEATURES if f not in WAITING)


def ci_seeds() -> tuple:
    """CI_SEEDS, or the one seed SHARDPROP_FUZZ_SEED names."""
    env = os.environ.get("SHARDPROP_FUZZ_SEED")
    return (int(env),) if env else CI_SEEDS


@pytest.mark.parametrize("seed", ci_seeds())
def test_quick_budget_has_no_failures(seed):
    command = f"python -m tests.fuzz --seed {seed} --n {QUICK_N}" + (
        f" --without {','.join(sorted(WAITING))}" if WAITING else "")
    print(f"fuzz seed {seed}: reproduce with SHARDPROP_FUZZ_SEED={seed}, or {command}")
    report = run_many(seed, QUICK_N, CI_FEATURES, shrink=False, out_dir=None, progress=False)
    print(report.line())
    assert report.failures == 0, f"{report.text()}\nreproduce and shrink: {command}"
    assert sum(report.counts.values()) == QUICK_N


# -- the fuzzer itself ----------------------------------------------------------------------------------
def test_programs_are_deterministic_and_cover_the_features():
    a = [render(generate(5, i)).source for i in range(60)]
    b = [render(generate(5, i)).source for i in range(60)]
    assert a == b
    ops = {ins.op for i in range(300) for ins in generate(5, i).instrs}
    assert {"reshape", "scan", "random", "conv", "pool", "topk", "einsum", "dot_general", "take"} <= ops
    wrappers = {generate(5, i).wrapper for i in range(300)}
    assert wrappers == {"fwd", "grad", "sgd", "adam"}
    assert {generate(5, i).mode for i in range(300)} == set(MODES)   # mode="auto" too
    without = {ins.op for i in range(100) for ins in generate(5, i, tuple(f for f in FEATURES if f != "scan")).instrs}
    assert "scan" not in without and without


def test_generated_marks_are_judged_as_drawn():
    """The judge (strategies.expect) agrees with the generator: a program is invalid exactly
    when an invalid strategy was planted; about 10% are."""
    planted = 0
    for i in range(400):
        p = generate(9, i)
        status = expect(p).status
        if p.planted:
            planted += 1
            assert status == INVALID, (i, p.planted, expect(p))
        else:
            assert status in (VALID, MAY_REJECT), (i, expect(p))
    assert 20 <= planted <= 70, planted


def _program(instrs, inputs, outputs, **kw):
    return Program(0, 0, inputs, instrs, outputs, **kw)


def test_shrinker_reaches_the_smallest_failing_program():
    """A synthetic failure (the program has a reshape whose input has 8 elements or more) shrinks
    to that one reshape on a small input: every other instruction, the marks, the grad wrapper,
    the mode and the extra outputs go."""
    p = next(q for q in (generate(3, i) for i in range(200))
             if len(q.instrs) >= 6 and q.wrapper == "grad" and any(ins.op == "reshape" for ins in q.instrs))

    def fails(q):
        from tests.fuzz.program import infer
        types = infer(q)
        return any(ins.op == "reshape" and types[ins.args[0]].size >= 8 for ins in q.instrs)
    assert fails(p)
    small = shrink(p, fails, budget_s=60)
    assert fails(small)
    assert [ins.op for ins in small.instrs] == ["reshape"]
    assert small.wrapper == "fwd" and small.mode == "sharding_propagation"
    assert all(ins.mark is None for ins in small.instrs) and not small.in_strategy
    assert len(small.outputs) == 1 and len(small.inputs) == 1
    assert next(iter(small.inputs.values())).size < 16


def _tanh_program(mark=None, mesh=8, **kw):
    return _program([Instr("unary", ("x0",), {"fn": "tanh"}, ("v0",), mark)], {"x0": TType((8, 4))}, ("v0",),
                    mesh=mesh, **kw)


def test_a_valid_program_is_right():
    o = run_program(_tanh_program(Mark((("s", (2, 4)),))))
    assert o.cls == "right", o.detail


def test_an_invalid_mark_is_rejected_with_a_complete_message():
    p = _tanh_program(Mark((("s", (3, 1)),)))       # 3 does not divide 8
    assert expect(p).status == INVALID
    o = run_program(p)
    assert o.cls == "rejected", o.detail
    assert "fuzz_0_0.py:16" in o.detail and "(8, 4)" in o.detail


def test_message_parts_are_checked():
    r = render(_tanh_program(Mark((("s", (3, 1)),))))
    good = ("shard(tanh) at fuzz_0_0.py:16: splits dim 0\n  shapes:   ((8, 4),)\n  strategy: ((3, 1),)\n"
            "  fix:      use 1, 2, 4 or 8")
    assert message_problems(good, r, (0,)) == []
    assert message_problems("shard(tanh): splits dim 0\n  fix: x", r, (0,)) == ["source", "shapes", "strategy"]
    assert message_problems(good.replace(":16", ":99"), r, (0,)) == ["source"]


@pytest.mark.parametrize("cls,fake", [
    ("wrong", lambda step: lambda *a: jax.tree_util.tree_map(lambda x: x + 1e-3, jax.jit(step)(*a))),
    ("crash", lambda step: lambda *a: (_ for _ in ()).throw(TypeError("boom"))),
    ("refused", lambda step: lambda *a: (_ for _ in ()).throw(sp.ShardingError("tanh at x.py:1: no"))),
])
def test_each_failure_class_is_reported(monkeypatch, cls, fake):
    monkeypatch.setattr(sp, "parallelize", lambda step, **kw: fake(step))
    assert run_program(_tanh_program()).cls == cls


def test_auto_under_a_memory_limit_is_drawn_and_an_error_that_nothing_fits_is_over_limit(monkeypatch):
    """Half the mode="auto" programs are searched under a memory limit, a share of their free
    plan's modeled peak (issue 27's 0.5, 0.7, 0.9). Its result is held to one device's like
    any other; a ShardingError that no plan fits the limit is ``over_limit`` (a limit that
    is a share of a tiny program's peak can be under what XLA compiles any plan to), where
    the same error without a limit is a refusal."""
    drawn = [generate(5, i) for i in range(400)]
    limited = [p for p in drawn if p.memory_share is not None]
    assert {p.memory_share for p in limited} == {0.5, 0.7, 0.9} and all(p.mode == "auto" for p in limited)
    assert all("memory_limit=max(1, int(" in render(p).source for p in limited)
    assert not any("memory_limit" in render(p).source for p in drawn if p.memory_share is None)
    assert run_program(_tanh_program(mode="auto", memory_share=0.9)).cls in ("right", "over_limit")

    class Free:
        def __init__(self, step, **kw):
            self.kw = kw

        def plan(self, *args):
            return type("Plan", (), {"cost": type("Cost", (), {"peak_memory": 1000})})()

        def __call__(self, *args):
            if "memory_limit" in self.kw:
                raise sp.ShardingError(f"no plan fits memory_limit={self.kw['memory_limit']:,} bytes per device once "
                                       f"compiled")
            raise sp.ShardingError("no plan fits memory_limit=700 bytes per device once compiled")
    monkeypatch.setattr(sp, "parallelize", Free)
    assert run_program(_tanh_program(mode="auto", memory_share=0.7)).cls == "over_limit"
    assert run_program(_tanh_program(mode="auto")).cls == "refused"
    # shrinking drops the limit alone, or with the mode (a limit is mode="auto"'s): never a
    # limit on another mode
    proposed = list(candidates(_tanh_program(mode="auto", memory_share=0.7)))
    assert any(q.mode == "auto" and q.memory_share is None for q in proposed)
    assert not any(q.mode != "auto" and q.memory_share is not None for q in proposed)
    assert size_of(_tanh_program(mode="auto")) < size_of(_tanh_program(mode="auto", memory_share=0.7))


def test_an_error_that_scales_with_the_precision_is_rounding_not_wrong(monkeypatch):
    """Past the float32 slack, both sides run again in float64: an error proportional to the
    machine epsilon (rounding amplified by cancellation) vanishes there, a wrong plan does not."""
    def rounding(step):
        def run(*a):
            return jax.tree_util.tree_map(
                lambda x: x + 3e-5 * float(np.finfo(x.dtype).eps / np.finfo(np.float32).eps), jax.jit(step)(*a))
        return run
    monkeypatch.setattr(sp, "parallelize", lambda step, **kw: rounding(step))
    assert run_program(_tanh_program()).cls == "right"


def test_invalid_strategies_accepted_or_badly_explained_are_reported(monkeypatch):
    p = _tanh_program(Mark((("s", (4, 4)),)))       # 16 devices: checked when parallelize binds it
    assert expect(p).status == INVALID
    monkeypatch.setattr(sp, "parallelize", lambda step, **kw: jax.jit(step))
    assert run_program(p).cls == "accepted_invalid"
    monkeypatch.setattr(sp, "parallelize", lambda step, **kw: lambda *a: (_ for _ in ()).throw(
        sp.ShardingError("shard(tanh) at fuzz_0_0.py:16: bad split")))
    o = run_program(p)
    assert o.cls == "bad_error" and "lacks shapes, strategy, fix" in o.detail
    assert set(CLASSES) == {"right", "rejected", "wrong", "crash", "refused", "accepted_invalid", "bad_error",
                            "over_limit"}


def test_compare_is_float32_rounding_and_exact_for_integers():
    w = np.linspace(-3, 3, 64, dtype=np.float32)
    assert compare([w * (1 + 4e-7)], [w]) is None                   # a few ulps
    # slack at w: 1e-5 * |w| + 1e-5 * max(1, max|w|) = 1e-5 * |w| + 3e-5
    assert compare([w + 2.5e-5], [w]) is None and compare([w + 7e-5], [w]) is not None
    assert compare([w.astype(np.int32)], [w.astype(np.int32) + 1]) is not None
    assert compare([w.astype(np.float16)], [w]) is not None
    assert compare([w[:8]], [w[:8].reshape(2, 4)]) is not None
    big = w * 1e4                                                    # slack scales with the largest magnitude
    assert compare([big + 0.2], [big]) is None and compare([big + 5.0], [big]) is not None


def test_reshape_marks_are_judged_by_contiguity():
    """A mark on a reshape's input may be refused only where the reshape cannot carry the split."""
    from tests.fuzz.ops import FAMILIES
    check = FAMILIES["reshape"].mark_check
    flatten = {"kind": "flatten"}
    assert check([TType((4, 2))], flatten, [[2], []]) is None             # major dim split: contiguous
    assert check([TType((4, 2))], flatten, [[], [2]]) is not None         # minor dim split under a whole major
    assert check([TType((4, 2))], flatten, [[2, 2], [2]]) is None         # major fully split first
    split = {"kind": "split", "dim": 0, "factor": 2}                     # (8,) -> (2, 4)
    assert check([TType((8,))], split, [[2, 4]]) is None                  # axis 2 on dim 0, 4 on dim 1
    assert check([TType((8,))], split, [[4, 2]]) is not None              # an axis of 4 straddles (2, 4)
