"""Input pipelines on grain: each process loads only its share of every global batch.

``DistributedSampler`` does the job of PyTorch's: a per-epoch shuffle (the same on
every process, reshuffled every epoch from one seed) cut into global batches, of
which process ``rank`` takes its contiguous share. The global batches are the same
whatever the number of processes or devices. The index pipeline is a grain
``MapDataset`` (shuffle, repeat per epoch, batch), so its shuffles are grain's
reproducible ones. ``DataLoader`` reads each process's share in grain's prefetch
threads and turns it into one global ``jax.Array`` laid out as the parallel step
wants it (``jax.make_array_from_process_local_data``), so nothing is gathered on a host.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

import grain
import jax
import numpy as np

from .distributed import initialize


class DistributedSampler:
    def __init__(self, num_samples: int, global_batch_size: int, *, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        initialize()   # (a multi-process run: join it before asking jax for the process count)
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

    def global_dataset(self) -> grain.MapDataset:
        """This epoch's global batches of sample indices, as a grain dataset."""
        n = self.num_samples
        ds = grain.MapDataset.range(n)
        if self.shuffle:
            # shuffle, then repeat: grain draws a new permutation for every epoch
            ds = ds.shuffle(seed=self.seed).repeat().slice(slice(self.epoch * n, (self.epoch + 1) * n))
        return ds.batch(self.global_batch_size, drop_remainder=True)

    def dataset(self) -> grain.MapDataset:
        """This process's share of each global batch."""
        share = self.global_batch_size // self.num_replicas
        lo = self.rank * share
        return self.global_dataset().map(lambda batch: np.asarray(batch)[lo:lo + share])

    def global_batches(self) -> Iterator[np.ndarray]:
        return (np.asarray(b) for b in self.global_dataset())

    def __iter__(self) -> Iterator[np.ndarray]:
        """This process's indices of each global batch."""
        return iter(self.dataset())


class DataLoader:
    """Global batches of ``arrays`` (each indexed on dim 0), placed with ``shardings``
    (one per array, e.g. from ``ParallelFunction.input_shardings``). Each process
    reads its share in ``num_threads`` grain threads, ``prefetch`` batches ahead."""

    def __init__(self, arrays: Sequence[np.ndarray], sampler: DistributedSampler, shardings: Sequence, *,
                 num_threads: int = 2, prefetch: int = 2):
        self.arrays, self.sampler, self.shardings = list(arrays), sampler, list(shardings)
        if len(self.shardings) != len(self.arrays):
            raise ValueError(f"{len(self.arrays)} arrays but {len(self.shardings)} shardings")
        self.read_options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        g = self.sampler.global_batch_size
        arrays = self.arrays
        local = self.sampler.dataset().map(lambda idx: tuple(a[idx] for a in arrays))
        for share in local.to_iter_dataset(self.read_options):
            yield tuple(jax.make_array_from_process_local_data(s, x, (g,) + x.shape[1:])
                        for x, s in zip(share, self.shardings))
