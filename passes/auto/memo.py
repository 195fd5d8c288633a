"""What the searches of one compile share, and nothing beyond it.

The memory check (``compiler/memory_check.py``) searches the same program again under
lower modeled limits; those searches build the same problem, so the LP model of the
last one (``warm_lp.WarmLP``: its basis and memory rows), the hand families' solves
and the arrangements' LP bounds are kept for the next. Kept past the compile, they made
a search's plan depend on what the process had searched before: the 12-layer GPT step
on 4 x 2 at 0.7 of its free peak searched 5.3 s to a plan of 95.05 ms cold, and 30.8 s
to one of 97.49 ms after a search of the same step at 0.5 (whose rows and basis it went
on from).
``one_compile`` scopes them: forgotten when the outermost compile starts and ends.
"""
from __future__ import annotations

from contextlib import contextmanager

# warm LP models by (problem fingerprint, memory signature), the newest few
WARM_MODELS: dict = {}
WARM_MODELS_MAX = 2
# hand families' plans solved for time (and made to fit) by (problem fingerprint,
# storage layouts[, limit]): a hand plan does not depend on the limit, only whether it fits
HAND_SOLVES: dict = {}
HAND_SOLVES_MAX = 64
# an arrangement's LP bound without memory rows by problem fingerprint (``search._by_bound``):
# the memory check's searches again have the same arrangements
LP_BOUNDS: dict = {}
LP_BOUNDS_MAX = 16

_depth = 0


def forget() -> None:
    """Drop every warm model and hand solve: the next search starts cold."""
    WARM_MODELS.clear()
    HAND_SOLVES.clear()
    LP_BOUNDS.clear()


def remember(store: dict, key, value, most: int) -> None:
    """``store[key] = value``, the oldest entries dropped to keep at most ``most``."""
    while len(store) >= most:
        store.pop(next(iter(store)))
    store[key] = value


@contextmanager
def one_compile():
    """The searches inside share warm models and hand solves; none from before is seen,
    none is left after (nested scopes share the outermost one's)."""
    global _depth
    if _depth == 0:
        forget()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            forget()
