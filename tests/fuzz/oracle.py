"""Running a program in parallel and on one device, and saying what happened.

Outcome classes:
  right            the parallel result equals the single-device one
  rejected         an invalid strategy (or a split of a dim the op needs whole) gave a good ShardingError
  wrong            silent wrong numbers
  crash            any exception other than ShardingError
  refused          a ShardingError on a valid program
  accepted_invalid an invalid strategy ran without error
  bad_error        a ShardingError for an invalid strategy whose message misses a part
  over_limit       (mode="auto" under a memory limit) a ShardingError that no plan fits the limit
"""
from __future__ import annotations

import os
import re
import time
import traceback
import types as pytypes
from dataclasses import dataclass, field
from typing import Optional

import jax
import numpy as np

from .program import Inconsistent, Program
from .render import Rendered, check, render
from .strategies import INVALID, MAY_REJECT, expect

CLASSES = ("right", "rejected", "wrong", "crash", "refused", "accepted_invalid", "bad_error", "over_limit")
FAILURES = ("wrong", "crash", "refused", "accepted_invalid", "bad_error")

# Tolerance: float32 rounding. eps = 1.2e-7; a reduction of up to a few hundred terms
# summed in another order (per-device partial sums, then a collective) differs by a few
# hundred ulps of the terms' magnitude at worst, so 1e-5 (~80 ulps) relative, plus an
# absolute slack of 1e-5 times the largest magnitude of the reference for elements that
# come out of cancellation (their error scales with the operands, not with themselves).
RTOL = 1e-5
ATOL = 1e-5
# Adam divides each gradient by its own root mean square: rounding noise in a gradient
# entry near zero is amplified by up to 1/eps. The programs use eps=1e-3, so parameters
# and moments after two Adam steps get a 10x looser factor.
LOOSE = {"adam": 10.0}


@dataclass
class Outcome:
    cls: str
    detail: str = ""                  # what differed, or the exception's message
    exc_type: str = ""
    first_line: str = ""
    where: str = ""                   # innermost shardprop frame (file:function) of a crash
    seconds: float = 0.0
    cpu_seconds: float = 0.0          # this process's CPU time (XLA's compile threads included)
    expected: str = ""                # valid | may_reject | invalid
    why: str = ""

    @property
    def signature(self) -> str:
        if self.cls in ("crash", "refused"):
            return f"{self.cls}: {self.exc_type}: {normalize(self.first_line)}" + (f" [{self.where}]" if self.where else "")
        if self.cls == "bad_error":
            return f"bad_error: {self.detail.splitlines()[0]}"
        if self.cls == "accepted_invalid":
            return f"accepted_invalid: {normalize(self.why)}"
        return self.cls


def normalize(line: str) -> str:
    """A message's first line with its numbers and names of values blanked, to group alike failures."""
    line = re.sub(r"fuzz_\w+\.py:\d+", "<src>", line)
    line = re.sub(r"\d+", "N", line)
    return line[:160]


class _NoMarks:
    """``sp`` for the single-device oracle: marks are dropped, the program is what remains."""
    @staticmethod
    def shard(fn, *a, **k):
        return fn


def load(rendered: Rendered, marks: bool = True) -> dict:
    ns = {"__name__": "fuzz_program", "__file__": rendered.filename}
    exec(compile(rendered.source, rendered.filename, "exec"), ns)
    if not marks:
        ns["sp"] = _NoMarks
    return ns


def compare(got, want, loose: float = 1.0) -> Optional[str]:
    """None if equal to float32 rounding (integers exact), else what differs."""
    g_leaves, g_tree = jax.tree_util.tree_flatten(got)
    w_leaves, w_tree = jax.tree_util.tree_flatten(want)
    if g_tree != w_tree:
        return f"structure {g_tree} != {w_tree}"
    for k, (g, w) in enumerate(zip(g_leaves, w_leaves)):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"leaf {k}: {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}"
        if not np.issubdtype(w.dtype, np.floating):
            bad = g != w
            if bad.any():
                return f"leaf {k}: {int(bad.sum())} of {w.size} integer entries differ, e.g. {g[bad][:3]} != {w[bad][:3]}"
            continue
        if not np.array_equal(np.isnan(g), np.isnan(w)):
            return f"leaf {k}: NaN in different places"
        fin = np.isfinite(w)
        if not np.array_equal(g[~fin & ~np.isnan(w)], w[~fin & ~np.isnan(w)]):
            return f"leaf {k}: infinities differ"
        gf, wf = g[fin].astype(np.float64), w[fin].astype(np.float64)
        if not np.isfinite(gf).all():
            return f"leaf {k}: non-finite where the reference is finite"
        scale = max(1.0, float(np.abs(wf).max(initial=0.0)))
        err = np.abs(gf - wf)
        bound = loose * (RTOL * np.abs(wf) + ATOL * scale)
        if (err > bound).any():
            i = int(np.argmax(err - bound))
            return (f"leaf {k} {w.dtype}{list(w.shape)}: max error {err.max():.3g} (scale {scale:.3g}), "
                    f"e.g. got {gf[i]:.6g} want {wf[i]:.6g}")
    return None


def message_problems(msg: str, rendered: Rendered, lines) -> list:
    """What a ShardingError's message lacks: operator, source line, shapes, strategy, fix."""
    first = msg.splitlines()[0] if msg else ""
    missing = []
    if not re.match(r"\s*\S+.*?:", first):
        missing.append("operator")
    src = re.findall(re.escape(rendered.filename) + r":(\d+)", msg)
    want = {rendered.mark_lines[i] for i in lines if i in rendered.mark_lines}
    if not src or (want and not want & {int(s) for s in src}):
        missing.append("source")
    for part in ("shapes", "strategy", "fix"):
        if not re.search(rf"^\s*{part}:\s*\S", msg, re.M):
            missing.append(part)
    return missing


def _about(msg: str, rendered: Rendered, exp) -> bool:
    """Whether a ShardingError is about the strategy the program got wrong (or the mark that
    splits a dim its op needs whole), rather than a refusal of something else in it."""
    first = msg.splitlines()[0] if msg else ""
    lines = {rendered.mark_lines[i] for i in exp.lines if i in rendered.mark_lines}
    named = {int(x) for x in re.findall(re.escape(rendered.filename) + r":(\d+)", msg)}
    if lines and (named & lines or (not named and "shard(" in first)):
        return True
    return exp.at_parallelize and "parallelize" in first


def _innermost_own_frame(exc) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if re.search(r"/(compiler|ir|passes|runtime)/", f.filename)
           and "site-packages" not in f.filename]
    if not own:
        return ""
    f = own[-1]
    parts = f.filename.split("/")
    return f"{'/'.join(parts[-2:])}:{f.name}"


def run_program(program: Program) -> Outcome:
    """Run one program both ways and classify what happened."""
    t0, c0 = time.perf_counter(), time.process_time()
    types = check(program)
    exp = expect(program, types)
    rendered = render(program)
    quiet = os.environ.get("SHARDPROP_PROGRESS")
    os.environ["SHARDPROP_PROGRESS"] = "0"          # no compile progress line per program
    try:
        out = _classify(program, rendered, exp)
    finally:
        if quiet is None:
            del os.environ["SHARDPROP_PROGRESS"]
        else:
            os.environ["SHARDPROP_PROGRESS"] = quiet
        if _count_and_maybe_clear():
            jax.clear_caches()
    out.seconds = time.perf_counter() - t0
    out.cpu_seconds = time.process_time() - c0
    out.expected, out.why = exp.status, exp.why
    return out


_RUNS = [0]


def _count_and_maybe_clear() -> bool:
    _RUNS[0] += 1
    return _RUNS[0] % 50 == 0       # compiled programs pile up in jax's caches otherwise


def _classify(program: Program, rendered: Rendered, exp) -> Outcome:
    import shardprop as sp
    ns = load(rendered)
    try:
        got = ns["run"](ns["parallel"], ns["make_inputs"]())
        got = jax.tree_util.tree_map(np.asarray, got)
    except sp.ShardingError as e:
        msg = str(e)
        first = msg.splitlines()[0] if msg else ""
        if program.memory_share is not None and exp.status != INVALID and _over_limit(first):
            return Outcome("over_limit", msg, "ShardingError", first)
        if exp.status == "valid" or _refuses_program(msg) or not _about(msg, rendered, exp):
            return Outcome("refused", msg, "ShardingError", first, _innermost_own_frame(e))
        about_marks = not (exp.at_parallelize and "parallelize" in first)
        missing = message_problems(msg, rendered, exp.lines if about_marks else ())
        if missing:
            return Outcome("bad_error", f"message lacks {', '.join(missing)}\n{msg}", "ShardingError", first)
        return Outcome("rejected", msg, "ShardingError", first)
    except Exception as e:  # noqa: BLE001 - any other exception is the failure we look for
        msg = str(e)
        first = msg.strip().splitlines()[0] if msg.strip() else ""
        return Outcome("crash", f"{type(e).__name__}: {msg}\n{traceback.format_exc(limit=-8)}", type(e).__name__,
                       first, _innermost_own_frame(e))
    if exp.status == INVALID:
        return Outcome("accepted_invalid", exp.why)
    # the reference runs only now: a program that fails in parallel needs no reference (shrinking is faster)
    ref = load(rendered, marks=False)
    want = jax.tree_util.tree_map(np.asarray, ref["run"](jax.jit(ref["step"]), ref["make_inputs"]()))
    diff = compare(got, want, LOOSE.get(program.wrapper, 1.0))
    if diff and not _agree_in_float64(rendered):
        return Outcome("wrong", diff)
    return Outcome("right")


def _agree_in_float64(rendered: Rendered) -> bool:
    """A second opinion where float32 results differ: both sides again in float64. A
    plan that is wrong is wrong in any precision; one that differs only by float32
    rounding, amplified where a result cancels to about zero (a layer norm of a
    constant row, the gradient of a sum of log_softmax), agrees there to ~1e-9."""
    try:
        with jax.enable_x64(True):
            def wide(x):
                x = np.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else x
                return x.astype(np.float64) if isinstance(x, np.ndarray) and x.dtype == np.float32 else x
            ns, ref = load(rendered), load(rendered, marks=False)
            got = ns["run"](ns["parallel"], jax.tree_util.tree_map(wide, ns["make_inputs"]()))
            want = ref["run"](jax.jit(ref["step"]), jax.tree_util.tree_map(wide, ref["make_inputs"]()))
            got, want = (jax.tree_util.tree_map(np.asarray, t) for t in (got, want))
    except Exception:  # noqa: BLE001 - no second opinion to be had: the float32 verdict stands
        return False
    g_leaves, w_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    if len(g_leaves) != len(w_leaves):
        return False
    for g, w in zip(g_leaves, w_leaves):
        if g.shape != w.shape:
            return False
        if not np.issubdtype(w.dtype, np.floating):
            if not np.array_equal(g, w):
                return False
            continue
        if not np.array_equal(np.isnan(g), np.isnan(w)):
            return False
        fin = np.isfinite(w)
        scale = max(1.0, float(np.abs(w[fin]).max(initial=0.0)))
        if (np.abs(g[fin] - w[fin]) > 1e-9 * np.abs(w[fin]) + 1e-9 * scale).any():
            return False
    return True


def _over_limit(first: str) -> bool:
    """Whether an error says that no plan fits the memory limit (a limit drawn as a share of
    the free plan's modeled peak can be under what any plan holds, or compiles to)."""
    return bool(re.search(r"memory_limit=[\d,]+ bytes per device", first))


def _refuses_program(msg: str) -> bool:
    """An error about the program itself (a primitive without a rule, a value type), which no
    strategy could change: a refusal even where the program also has a bad strategy."""
    return bool(re.search(r"has no sharding rule|not supported inside a parallelized function", msg))


def same_failure(a: Outcome, b: Outcome) -> bool:
    """Whether a shrunk program still fails the way the original did."""
    if a.cls != b.cls:
        return False
    if a.cls in ("crash", "refused"):
        return a.exc_type == b.exc_type and normalize(a.first_line) == normalize(b.first_line)
    if a.cls == "bad_error":
        return a.detail.splitlines()[0] == b.detail.splitlines()[0]
    return True
