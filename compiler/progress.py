"""Compile progress: a long compile shows its stages, a short one shows nothing.

Planning, lowering and XLA's compile of a large model take seconds to minutes,
and a silent terminal looks like a hang. Nothing is printed until a compile has
run ``delay_s``; from then on the current stage is shown (a live line with rich
on a terminal, one line per stage otherwise) and, at the end, the time of each
stage. ``parallelize(..., progress=False)`` or ``SHARDPROP_PROGRESS=0`` keeps
it quiet.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Optional

DELAY_S = 2.0


def enabled(requested: Optional[bool]) -> bool:
    if requested is not None:
        return bool(requested)
    return os.environ.get("SHARDPROP_PROGRESS", "1").lower() not in ("0", "false", "no", "off")


class CompileProgress:
    """``with CompileProgress(name) as p: p.stage("tracing"); ...``."""

    def __init__(self, name: str, *, show: bool = True, delay_s: Optional[float] = None, stream=None):
        self.name = name
        self.show = show
        self.delay_s = DELAY_S if delay_s is None else delay_s
        self.stream = stream if stream is not None else sys.stderr
        self.stages: list[tuple[str, float]] = []   # (stage, start time)
        self._shown = False
        self._lock = threading.Lock()
        self._timer: Optional[threading.Timer] = None
        self._live = None

    # -- public ---------------------------------------------------------------
    def __enter__(self) -> "CompileProgress":
        self.t0 = time.perf_counter()
        if self.show:
            self._timer = threading.Timer(self.delay_s, self._start_showing)
            self._timer.daemon = True
            self._timer.start()
        return self

    def stage(self, what: str) -> None:
        with self._lock:
            self.stages.append((what, time.perf_counter()))
            if self._shown:
                self._render()

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        end = time.perf_counter()
        with self._lock:
            if not self._shown:
                return
            if self._live is not None:
                self._live.stop()
            times = [(s, (self.stages[i + 1][1] if i + 1 < len(self.stages) else end) - t)
                     for i, (s, t) in enumerate(self.stages)]
            parts = ", ".join(f"{s} {dt:.1f}s" for s, dt in times)
            status = "failed" if exc and exc[0] is not None else "compiled"
            print(f"shardprop: {self.name} {status} in {end - self.t0:.1f}s ({parts})", file=self.stream, flush=True)

    # -- showing --------------------------------------------------------------
    def _start_showing(self) -> None:
        with self._lock:
            self._shown = True
            if _is_terminal(self.stream):
                try:
                    from rich.console import Console
                    self._live = Console(file=self.stream).status("")
                    self._live.start()
                except ImportError:   # rich is optional: plain lines then
                    self._live = None
            self._render()

    def _render(self) -> None:
        what = self.stages[-1][0] if self.stages else "starting"
        elapsed = time.perf_counter() - self.t0
        text = f"shardprop: {self.name}: {what} ({elapsed:.1f}s so far)"
        if self._live is not None:
            self._live.update(text)
        else:
            print(text, file=self.stream, flush=True)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
