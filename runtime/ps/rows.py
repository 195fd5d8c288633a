"""A batch's view of the tables: each ids field's unique ids, padded to a bucket
size (few distinct shapes, so the jitted step compiles a few times, not every
step), and the batch rewritten to index the small local table instead."""
from __future__ import annotations

import numpy as np

MIN_BUCKET = 64


def bucket(n: int) -> int:
    """The next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << max(0, int(n - 1).bit_length()))


class BatchRows:
    """For one batch: ``unique[field]`` the distinct ids (ascending) and the batch
    with ids replaced by positions in that list."""

    def __init__(self, batch: dict, fields: set):
        self.unique = {}
        self.batch = dict(batch)
        for f in fields:
            ids = np.asarray(batch[f])
            uniq, inverse = np.unique(ids, return_inverse=True)
            self.unique[f] = uniq
            self.batch[f] = inverse.reshape(ids.shape).astype(np.int32)

    def padded_rows(self, field: str) -> int:
        return bucket(len(self.unique[field]))
