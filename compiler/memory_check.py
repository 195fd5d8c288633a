"""``memory_limit`` against the compiled program (``mode="auto"``).

The search keeps its *modeled* peak under the limit (``passes/auto/memory.py``),
but XLA adds what the model does not see: its own schedule (a redistribution
hoisted early stays alive longer), layout copies and how it packs its scratch.
So the compiled program is the judge: what ``memory_analysis()`` reports per
device (arguments + outputs + temp - aliased by donation + generated code) must
fit the limit. When it does not, the search runs again with the modeled limit
lowered by the measured excess (``ModeledLimits``), a few rounds; each round is
kept for ``plan.cost``, and if none fits a ShardingError gives every round's
figures.

The check compiles the program jit will run (same function, same argument
shardings and types), so the first call finds it in jax's cache: a plan that fits
the first time is compiled once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax

from ..ir.errors import ShardingError

MAX_ROUNDS = 5      # searches at most (each compiles the plan it finds): the first, 4 more


@dataclass(frozen=True)
class CompiledMemory:
    """Bytes per device of one compiled program, as XLA's buffer assignment reports them."""
    arguments: int
    outputs: int
    temp: int
    aliased: int          # outputs written into donated arguments (counted once, as arguments)
    code: int             # generated code on the device (0 on CPU)

    @property
    def total(self) -> int:
        return self.arguments + self.outputs + self.temp - self.aliased + self.code

    def __str__(self):
        mb = 1e-6
        return (f"{self.total * mb:.2f} MB (arguments {self.arguments * mb:.2f} + outputs {self.outputs * mb:.2f} "
                f"+ temp {self.temp * mb:.2f} - aliased {self.aliased * mb:.2f} + code {self.code * mb:.2f})")


@dataclass(frozen=True)
class MemoryRound:
    """One search: the modeled limit it was held to and, if it found a plan, the plan's
    modeled peak and what its program compiled to."""
    modeled_limit: int
    modeled_peak: Optional[float] = None
    compiled: Optional[CompiledMemory] = None

    def __str__(self):
        head = f"searched under modeled limit {self.modeled_limit * 1e-6:.2f} MB: "
        if self.compiled is None:
            return head + "no plan"
        return head + f"modeled peak {self.modeled_peak * 1e-6:.2f} MB, compiled {self.compiled}"


class ModeledLimits:
    """Which modeled limit to search under next, from the rounds so far. A plan over the
    limit by E bytes: the next plan must model below its peak (or its modeled limit, if
    lower) by E, on the reading that XLA adds about as much to it. A search that finds
    nothing under a modeled limit: halfway back up towards the last plan's peak
    (XLA's addition was that plan's own, not every plan's)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.rounds: list[MemoryRound] = []
        self.ceiling = limit      # the next plan must model below this
        self.floor = 0            # no plan models under this

    def add(self, r: MemoryRound) -> None:
        self.rounds.append(r)
        if r.compiled is None:
            self.floor = max(self.floor, r.modeled_limit)
        else:
            self.ceiling = min(self.ceiling, r.modeled_limit, int(r.modeled_peak) - 1)

    def next(self) -> Optional[int]:
        """The next modeled limit, or None when the rounds are spent or nothing is left
        between what did not fit and what found no plan."""
        if len(self.rounds) >= MAX_ROUNDS:
            return None
        last = self.rounds[-1]
        if last.compiled is not None:
            want = self.ceiling - (last.compiled.total - self.limit)
            if want <= 0:         # XLA added more than the whole modeled plan: no modeled limit helps
                return None
            if want > self.floor:
                return want
        if self.ceiling - self.floor < self.limit // 100:     # under 1% of the limit left to split
            return None
        return (self.floor + self.ceiling) // 2


def compiled_memory(jitted, abstract_args) -> Optional[CompiledMemory]:
    """Compile ``jitted`` for ``abstract_args`` and read its footprint; None where the
    backend reports none."""
    m = jitted.lower(*abstract_args).compile().memory_analysis()
    if m is None:
        return None
    return CompiledMemory(int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.temp_size_in_bytes),
                          int(m.alias_size_in_bytes), int(m.generated_code_size_in_bytes))


def abstract_inputs(values, shardings) -> list:
    """What jit sees of the placed inputs (shape, dtype, weak type, sharding), without
    placing them: the check's compile is the one the call reuses."""
    out = []
    for x, s in zip(values, shardings):
        a = jax.api_util.shaped_abstractify(x)
        out.append(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s, weak_type=a.weak_type))
    return out


def does_not_fit(limit: int, rounds: list, largest: list) -> ShardingError:
    """No plan's compiled program fits: every round's figures, and the tensors the model
    finds largest where the last plan found peaks."""
    lines = "; ".join(f"round {k}: {r}" for k, r in enumerate(rounds, start=1))
    names = "; ".join(f"{name} {shape} ({nbytes / 2**20:.2f} MiB per device)" for name, shape, nbytes in largest)
    return ShardingError(
        f"no plan fits memory_limit={limit:,} bytes per device once compiled ({lines})"
        + (f"; the largest tensors where the last plan's modeled peak is: {names}" if names else "")
        + ". XLA's temp is scratch the model does not see (layout copies, its schedule). Fix: raise memory_limit, "
          "use more devices, donate the state (donate_argnums), or shrink the batch or the model")
