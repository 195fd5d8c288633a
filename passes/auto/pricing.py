"""The search's prices are the planners' one price of a move: ``plan_core.pricing``
(this name stays for code that imports it from here)."""
from ..plan_core.pricing import Prices  # noqa: F401
