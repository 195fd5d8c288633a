"""Pipeline parallelism's pure planning layer (issue 26): schedules, their simulator and
the stage-cut dynamic program. No JAX, and nothing from ``compiler/`` or ``runtime/``:
the lowering and the search import these, never the other way round.

- :mod:`.schedules`: ``build_schedule(name, p, m, v)`` -> per-stage ``Action`` orders for
  ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` and ``"zero_bubble"`` (ZB-H1);
- :mod:`.simulate`: ``simulate(schedule, durations, latency)`` -> makespan, tick table,
  bubble, busy time and activations in flight; deadlocks raise ``DeadlockError``;
- :mod:`.cuts`: ``plan_cuts(layer_time, p, m, ...)`` -> contiguous stage cuts minimising
  the modeled step time (exchanges and the schedule's bubble included) under a memory
  limit, and ``brute_force_cuts`` as its reference;
- :mod:`.search`: ``search_pipeline(costs, devices, batch, cost)`` -> the fastest
  pp x dp x tp x micro-batches x schedule (x virtual stages) x cuts under a memory limit,
  every candidate ranked or rejected with its reason.
"""
from .schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, KINDS, SCHEDULES,  # noqa: F401
                        Action, Schedule, build_schedule, from_orders)
from .simulate import DeadlockError, Event, SimResult, simulate  # noqa: F401
from .cuts import StageCuts, brute_force_cuts, evaluate_cuts, even_bounds, plan_cuts  # noqa: F401
from .search import Candidate, LayerCosts, SearchResult, equal_layer_candidate, search_pipeline  # noqa: F401
