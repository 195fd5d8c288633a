"""``mode="auto"``: strategies searched, not propagated.

Every op (or op cluster) picks one strategy from the candidates its factor rule
allows; edges between them carry the redistribution planner's costs; a memory
limit bounds the modeled live peak; HiGHS (``scipy.optimize.milp``) solves it.
``candidates`` says what may be chosen, ``problem`` what each choice costs,
``milp`` how the choice is made, ``search`` is the pass that ties them together.
"""
from .memory import parse_memory_limit  # noqa: F401
from .search import SearchStrategies  # noqa: F401
