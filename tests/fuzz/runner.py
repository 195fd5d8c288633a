"""Running many programs (in worker processes if asked), shrinking one failure per
signature, and the report."""
from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

DEVICES = 8


def configure_devices() -> None:
    """8 forced CPU devices; must run before jax creates its backend."""
    flag = f"--xla_force_host_platform_device_count={DEVICES}"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    import jax
    try:
        jax.config.update("jax_num_cpu_devices", DEVICES)
    except RuntimeError:
        pass            # the backend is already up (under pytest's conftest, with the same count)


class _Timeout(Exception):
    pass


def _with_timeout(seconds, fn, *args):
    """fn(*args), raising _Timeout after ``seconds``. It nests inside an enclosing SIGALRM
    limit (pytest-timeout's, under pytest): that limit's timer is put back afterwards, less
    the time spent, and if it expires first its own handler runs."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        return fn(*args)
    outer_handler = signal.getsignal(signal.SIGALRM)
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    outer_deadline = time.monotonic() + outer_left if outer_left else None
    outer_fired = []

    def alarm(signum, frame):
        if outer_deadline is not None and time.monotonic() >= outer_deadline - 0.01 and callable(outer_handler):
            outer_fired.append(True)
            return outer_handler(signum, frame)
        raise _Timeout(f"no result after {seconds} s")
    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, min(seconds, outer_left) if outer_left else seconds)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_deadline is not None and not outer_fired:
            signal.setitimer(signal.ITIMER_REAL, max(outer_deadline - time.monotonic(), 0.01))


def outcome_of(program, timeout: Optional[float] = 120):
    """run_program, with the fuzzer's own mistakes and hangs turned into outcomes too."""
    from .oracle import Outcome, run_program
    from .program import Inconsistent
    t0 = time.perf_counter()
    try:
        return _with_timeout(timeout, run_program, program)
    except _Timeout as e:
        return Outcome("crash", str(e), "Timeout", str(e), seconds=time.perf_counter() - t0)
    except Inconsistent as e:
        return Outcome("fuzzer_error", f"Inconsistent: {e}", "Inconsistent", str(e), seconds=time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - the reference itself failed: the generator made a bad program
        return Outcome("fuzzer_error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-6)}", type(e).__name__,
                       str(e).splitlines()[0] if str(e) else "", seconds=time.perf_counter() - t0)


def run_index(seed: int, index: int, features, timeout: Optional[float] = 120):
    from .generate import generate
    try:
        program = generate(seed, index, features)
    except Exception as e:  # noqa: BLE001
        from .oracle import Outcome
        return index, Outcome("fuzzer_error", f"generate: {type(e).__name__}: {e}", type(e).__name__, str(e)), 0
    return index, outcome_of(program, timeout), len(program.instrs)


def shrink_index(seed: int, index: int, features, budget_s: float = 120.0, timeout: Optional[float] = 120):
    """The shrunk program of a failure and its outcome (the original's if nothing was smaller)."""
    from .generate import generate
    from .oracle import same_failure
    from .shrink import shrink
    program = generate(seed, index, features)
    first = outcome_of(program, timeout)
    small = shrink(program, lambda q: same_failure(first, outcome_of(q, timeout)), budget_s=budget_s)
    return index, small, outcome_of(small, timeout) if small is not program else first


@dataclass
class Report:
    seed: int
    n: int
    counts: Counter = field(default_factory=Counter)
    by_signature: dict = field(default_factory=dict)     # signature -> [(index, Outcome)]
    repros: dict = field(default_factory=dict)           # signature -> (path or None, snippet, Outcome)
    seconds: float = 0.0
    times: list = field(default_factory=list)

    @property
    def failures(self) -> int:
        from .oracle import FAILURES
        return sum(self.counts[c] for c in FAILURES) + self.counts["fuzzer_error"]

    def line(self) -> str:
        from .oracle import CLASSES
        parts = [f"{c} {self.counts[c]}" for c in CLASSES]
        if self.counts["fuzzer_error"]:
            parts.append(f"fuzzer_error {self.counts['fuzzer_error']}")
        return f"fuzz: {self.n} programs, seed {self.seed}: " + ", ".join(parts)

    def text(self) -> str:
        out = []
        for sig, items in sorted(self.by_signature.items(), key=lambda kv: -len(kv[1])):
            idx = ", ".join(str(i) for i, _ in items[:8]) + (" ..." if len(items) > 8 else "")
            out.append(f"\n{len(items)} x {sig}\n    programs: {idx}")
            if sig in self.repros:
                path, snippet, o = self.repros[sig]
                out.append(f"    shrunk repro{f' ({path})' if path else ''}:")
                out.append("\n".join("      " + line for line in _body(snippet)))
                detail = o.detail.strip().splitlines()[:6]
                out.append("    outcome: " + "\n             ".join(detail))
        if self.times:
            wall = sorted(t[0] for t in self.times)
            cpu = sorted(t[1] for t in self.times)
            slow = sorted(self.times, reverse=True)[:3]
            out.append(f"\nseconds per program: wall mean {sum(wall) / len(wall):.2f}, median {wall[len(wall) // 2]:.2f}, "
                       f"max {wall[-1]:.2f}; CPU mean {sum(cpu) / len(cpu):.2f}, median {cpu[len(cpu) // 2]:.2f}; "
                       f"slowest {', '.join(f'#{i} {w:.1f}s' for w, _, i in slow)}; total wall {self.seconds:.0f} s")
        out.append(self.line())
        return "\n".join(out)


def _body(snippet: str) -> list:
    """The interesting part of a snippet: from ``def f`` to the parallelize call."""
    lines = snippet.splitlines()
    try:
        a = next(i for i, l in enumerate(lines) if l.startswith("def f("))
        b = next(i for i, l in enumerate(lines) if l.startswith("parallel = "))
        return [l for l in lines[a:b + 1] if l.strip()]
    except StopIteration:
        return lines


def run_many(seed: int, n: int, features, *, jobs: int = 1, start: int = 0, shrink: bool = True,
             out_dir: Optional[str] = "fuzz_failures", shrink_budget: float = 120.0, timeout: float = 120,
             progress: bool = True, indices=None) -> Report:
    from .oracle import FAILURES
    from .render import render
    features = tuple(features)
    indices = list(indices) if indices is not None else list(range(start, start + n))
    report = Report(seed, len(indices))
    t0 = time.perf_counter()
    pool = _pool(jobs) if jobs > 1 else None
    try:
        results = _map(pool, run_index, [(seed, i, features, timeout) for i in indices], progress,
                       f"seed {seed}", report)
        for index, outcome, _ in sorted(results, key=lambda r: r[0]):
            report.counts[outcome.cls] += 1
            report.times.append((outcome.seconds, outcome.cpu_seconds, index))
            if outcome.cls in FAILURES or outcome.cls == "fuzzer_error":
                report.by_signature.setdefault(outcome.signature, []).append((index, outcome))
        if shrink and report.by_signature:
            # shrink the smallest program of each signature
            sizes = {r[0]: r[2] for r in results}
            todo = [(seed, min(items, key=lambda it: sizes[it[0]])[0], features, shrink_budget, timeout)
                    for sig, items in report.by_signature.items() if not sig.startswith("fuzzer_error")]
            shrunk = _map(pool, shrink_index, todo, progress, "shrinking", None)
            index_sig = {i: sig for sig, items in report.by_signature.items() for i, _ in items}
            for index, small, o in shrunk:
                sig = index_sig[index]
                name = f"{o.cls}_{seed}_{index}.py"
                snippet = render(small, name).source
                path = None
                if out_dir:
                    Path(out_dir).mkdir(parents=True, exist_ok=True)
                    path = str(Path(out_dir) / name)
                    Path(path).write_text(snippet)
                report.repros[sig] = (path, snippet, o)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    report.seconds = time.perf_counter() - t0
    return report


def _pool(jobs: int):
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    configure_devices()          # children inherit XLA_FLAGS from the environment
    return ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"), initializer=configure_devices)


def _map(pool, fn, arglist, progress, what, report):
    """fn over arglist (in the pool if any), with a progress bar."""
    bar = _Bar(len(arglist), what, progress)
    out = []
    try:
        if pool is None:
            for args in arglist:
                r = fn(*args)
                out.append(r)
                bar.advance(r, report)
        else:
            from concurrent.futures import as_completed
            futures = [pool.submit(fn, *args) for args in arglist]
            for f in as_completed(futures):
                r = f.result()
                out.append(r)
                bar.advance(r, report)
    finally:
        bar.close()
    return out


class _Bar:
    def __init__(self, total, what, enabled):
        self.counts = Counter()
        self.progress = None
        if not enabled or not total:
            return
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            return
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[counts]}"), transient=False)
        self.progress.start()
        self.task = self.progress.add_task(what, total=total, counts="")

    def advance(self, result, report):
        if self.progress is None:
            return
        if report is not None:
            self.counts[result[1].cls] += 1
        counts = " ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        self.progress.update(self.task, advance=1, counts=counts)

    def close(self):
        if self.progress is not None:
            self.progress.stop()
