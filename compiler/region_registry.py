"""The ``shard()`` calls a traced program holds, by region id.

A ``shard()`` call brackets its operator with ``shardprop_mark`` equations whose
``region`` param is a ``RegionId``: an int (the params stay small and hashable, and
the IR keys regions by it) that also holds the call's ``Region``. So a region lives
exactly as long as something holds its marks: a jaxpr, a ``Graph``, or jax's own
caches (bounded LRUs: the trace of a jitted function still alive, whose marks a later
trace reuses; the abstract-eval cache, which keeps the params of its last 2048
calls). Nothing of shardprop's keeps one, so retracing in a long-lived process grows
no table of ours. ``REGIONS`` is a weak view of the regions alive now.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Optional

# A tensor strategy after normalisation: ("splits", (2, 4)) or ("axes", (("dp",), ())).
TensorStrategy = tuple


@dataclass(frozen=True)
class Region:
    """One call of a ``shard()``-wrapped function."""
    id: int
    name: str
    source: str
    in_strategy: tuple[TensorStrategy, ...]
    out_strategy: Optional[tuple[TensorStrategy, ...]]
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    user_in_strategy: Any
    user_out_strategy: Any
    factors: Any = None   # compiler.regions.RegionFactors, when split counts need binding

    def describe(self) -> str:
        return f"shard({self.name})"

    def operator(self) -> str:
        prims = self.factors.operators if self.factors is not None else ()
        shown = prims and len(prims) <= 3 and tuple(prims) != (self.name,)
        return self.describe() + (f" ({', '.join(prims)})" if shown else "")


class RegionId(int):
    """A region's id as a mark's param: equal to (and printed as) the int, and holding
    the ``Region`` once the call has made it (``region``; None until then)."""
    region: Optional[Region] = None


# region id -> Region, for the regions some RegionId still holds
REGIONS: "weakref.WeakValueDictionary[int, Region]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)


def new_region_id() -> RegionId:
    return RegionId(next(_ids))


def record(rid: RegionId, region: Region) -> None:
    """The call's region, held by its id (and so by every mark that carries it)."""
    rid.region = region
    REGIONS[int(rid)] = region


def region_of(rid) -> Region:
    """The Region a mark's ``region`` param names."""
    region = getattr(rid, "region", None)
    if region is None:
        region = REGIONS.get(int(rid))
    if region is None:
        raise KeyError(f"shard() region {int(rid)} is not known: its marks were made outside this process "
                       "or before the call finished")
    return region
