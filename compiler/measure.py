"""``mode="auto", measure=True``: time the plans the model ranks close, keep the fastest.

The search ranks plans by the cost model. Where the model describes the hardware
poorly, plans it puts a few percent apart can run the other way round: on forced CPU
devices, whose collectives are a rendezvous of threads on shared cores, Megatron's
marks ran 1.2x faster than the plan the model ranked 3% cheaper
(docs/results/search_and_memory.md). Compiling and running a handful of steps costs
seconds, so with ``measure=True`` the compiler times the search's plan beside the hand
plans (``passes/auto/hand.py``) that fit and that the model prices within
``MEASURE_WITHIN`` of it, and returns the fastest, as DeepSpeed's autotuner runs
short trials and Alpa profiles its stage candidates rather than trust a model alone.

What is measured: each compiled step on inputs of the arguments' shapes, dtypes and
layouts (zeros: the user's arrays are neither read nor donated), in turns, the median
of ``MEASURE_REPS`` runs each after one warm-up run, so that a machine's load drifts
over every candidate alike.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp

MEASURE_WITHIN = 1.5    # hand plans priced (as written) at most this times the search's plan
MEASURE_MAX = 4         # at most this many hand plans besides the search's plan
MEASURE_REPS = 5


@dataclass(frozen=True)
class Measured:
    """One timed candidate (``plan.cost.measured``)."""
    name: str                  # "search" or a hand plan's label
    modeled: float             # its modeled step as written (seconds)
    seconds: Optional[float]   # median measured step, None where it was not run
    note: str = ""             # why not run (over the memory limit), or "kept"

    def __str__(self):
        took = f"{self.seconds * 1e3:.3f} ms measured" if self.seconds is not None else "not run"
        return f"{self.name}: modeled {self.modeled * 1e3:.4f} ms, {took}" + (f" ({self.note})" if self.note else "")


def candidates(hand_plans: list, modeled: float, limit: Optional[float] = None) -> list:
    """The hand plans worth timing beside a plan modeled at ``modeled`` seconds (as
    written): solved, modeled under the user's memory ``limit`` (not the lower limit the
    memory check may have set for the search's own plan: a plan's compiled peak, checked
    before it is timed, decides), priced within MEASURE_WITHIN of it, cheapest first,
    one per price (hand plans of different names that the solver made the same plan
    price alike)."""
    out, prices = [], set()
    solved = (h for h in hand_plans if h.choice is not None and h.written is not None and
              (h.fits if limit is None else h.peak <= limit))
    for h in sorted(solved, key=lambda h: h.written):
        price = round(h.written, 12)
        if h.written <= MEASURE_WITHIN * modeled and price not in prices:
            out.append(h)
            prices.add(price)
    return out[:MEASURE_MAX]


def zero_inputs(abstract: list) -> list:
    """Arrays of each ``jax.ShapeDtypeStruct``'s shape and dtype, placed in its sharding."""
    return [jax.device_put(jnp.zeros(a.shape, a.dtype), a.sharding) for a in abstract]


def median_steps(steps: list[tuple[Callable, Callable[[], list]]], reps: int = MEASURE_REPS) -> list[float]:
    """Each ``(fn, make_inputs)``'s median seconds of ``fn(*make_inputs())`` over ``reps``
    runs, the steps run in turns after one warm-up run each. The inputs are made before
    each run and outside its time (a step may donate them)."""
    for fn, make_inputs in steps:
        jax.block_until_ready(fn(*make_inputs()))
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(reps):
        for i, (fn, make_inputs) in enumerate(steps):
            inputs = jax.block_until_ready(make_inputs())
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*inputs))
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]
