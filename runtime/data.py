"""Input pipelines: each process loads only its share of every global batch.

``DistributedSampler`` does the job of PyTorch's: a per-epoch shuffle (the same
on every process, seeded by ``seed + epoch``) cut into global batches, of which
process ``rank`` takes its contiguous share. The global batches are the same
whatever the number of processes or devices. ``DataLoader`` turns each process's
share into one global ``jax.Array`` laid out as the parallel step wants it
(``jax.make_array_from_process_local_data``), so nothing is gathered on a host.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

import jax
import numpy as np


class DistributedSampler:
    def __init__(self, num_samples: int, global_batch_size: int, *, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        self.num_replicas = jax.process_count() if num_replicas is None else num_replicas
        self.rank = jax.process_index() if rank is None else rank
        if global_batch_size % self.num_replicas:
            raise ValueError(f"global batch size {global_batch_size} does not divide over {self.num_replicas} "
                             "processes; use a multiple of the process count")
        if not drop_last and num_samples % global_batch_size:
            raise ValueError("drop_last=False needs a sample count divisible by the global batch size")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for this epoch (call it at the start of every epoch, as with PyTorch's)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples // self.global_batch_size

    def global_batches(self) -> Iterator[np.ndarray]:
        order = (np.random.default_rng(self.seed + self.epoch).permutation(self.num_samples)
                 if self.shuffle else np.arange(self.num_samples))
        for b in range(len(self)):
            yield order[b * self.global_batch_size:(b + 1) * self.global_batch_size]

    def __iter__(self) -> Iterator[np.ndarray]:
        """This process's indices of each global batch."""
        share = self.global_batch_size // self.num_replicas
        for batch in self.global_batches():
            yield batch[self.rank * share:(self.rank + 1) * share]


class DataLoader:
    """Global batches of ``arrays`` (each indexed on dim 0), placed with ``shardings``
    (one per array, e.g. from ``ParallelFunction.input_shardings``)."""

    def __init__(self, arrays: Sequence[np.ndarray], sampler: DistributedSampler, shardings: Sequence):
        self.arrays, self.sampler, self.shardings = list(arrays), sampler, list(shardings)
        if len(self.shardings) != len(self.arrays):
            raise ValueError(f"{len(self.arrays)} arrays but {len(self.shardings)} shardings")

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        g = self.sampler.global_batch_size
        for local in self.sampler:
            yield tuple(jax.make_array_from_process_local_data(s, a[local], (g,) + a.shape[1:])
                        for a, s in zip(self.arrays, self.shardings))
