"""What both planning engines stand on: propagation (``passes/propagate*.py``) and the
strategy search (``passes/auto/``).

- ``context``: one context per graph (rules interned, op signatures, producers and
  users, values fusion keeps out of memory, the step's end), built once;
- ``pricing``: one price of a move (redistribution, completion of a partial, the
  step-end discount);
- ``evaluate``: one evaluator of a whole plan (the number ``plan.cost`` reports, that
  propagation's rounds compare and that the search's objective equals);
- ``improve``: one local-improvement step (the cheapest neighbouring strategy that
  beats the current one, and the climb that repeats it);
- ``write``: one plan writer and one set of origin words.
"""
