"""One local-improvement step: move to the neighbouring strategy that lowers the price.

Both engines improve a plan locally by the same rule: among the neighbours of what
is there now (propagation: a mesh axis inserted into or moved between one op's
factors; the search's refinement: an op, with what follows it, taking a layout a
neighbour proposes or a free slice), take the one whose price beats what is there
and every earlier neighbour (the first of equals), where the engine admits it; none
such: stay. ``best_move`` is that step; a climb repeats it from where it lands.
"""
from __future__ import annotations

import operator
from typing import Callable, Iterable, Optional


def best_move(moves: Iterable, price: Callable, current, better: Callable = operator.lt,
              admit: Optional[Callable] = None) -> Optional[tuple]:
    """The move to take: (move, its price), or None where no move beats ``current``.

    ``price(move, bound)``: what the plan costs with the move (it may stop counting once
    past ``bound``, the price to beat); ``better(a, b)``: whether price ``a`` beats ``b``;
    ``admit(move, price)``: whether the engine takes such a move at all."""
    best, best_price = None, current
    for move in moves:
        p = price(move, best_price)
        if better(p, best_price) and (admit is None or admit(move, p)):
            best, best_price = move, p
    return None if best is None else (best, best_price)
