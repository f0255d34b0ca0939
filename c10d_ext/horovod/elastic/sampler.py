"""ElasticSampler (Horovod's ``horovod.torch.elastic.sampler``)."""

from __future__ import annotations

import math
import random

import torch.utils.data

from ..mpi_ops import rank, size


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions a dataset across the ranks, like ``DistributedSampler``, and repartitions
    what is left of the epoch when the set of ranks changes.

    Keep it in a ``TorchState``, call ``record_batch`` after each batch (it counts the samples
    the whole job has processed) and ``set_epoch`` at the *end* of each epoch. After a reset,
    the state's sync reloads the committed count, and the samples not yet processed are split
    among the new ranks.

    Args:
        dataset: the dataset (of constant length).
        shuffle: shuffle the indices (the same way on every rank) each epoch.
        seed: the shuffle's seed, identical on every rank; the epoch is added to it.
    """

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed

        self.epoch = 0
        self.processed_indices = set()  # kept for Horovod's attribute set; the count is what is used

        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices = []
        self.num_samples = 0
        self.total_size = 0
        self.processed_num = 0

        self.reset()

    def set_epoch(self, epoch):
        """Starts epoch `epoch`: a new shuffle and nothing processed. Call it at the end of an
        epoch, so that a reset in the middle of one does not process samples twice."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Counts one batch of `batch_size` samples on every rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def load_state_dict(self, state_dict):
        self.epoch = state_dict['epoch']
        self.processed_num = state_dict['processed_num']
        self.reset()

    def state_dict(self):
        return {'epoch': self.epoch, 'processed_num': self.processed_num}

    def reset(self):
        """Re-reads the world (size, rank) and splits the samples not yet processed."""
        self.num_replicas = size()
        self.rank = rank()

        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]

        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = list(self.remaining_indices)
        indices += indices[:self.total_size - len(indices)]  # pad to a multiple of the ranks
        assert len(indices) == self.total_size
        self.indices = indices[self.rank:self.total_size:self.num_replicas]
        assert len(self.indices) == self.num_samples
        return iter(self.indices)

    def __len__(self):
        return self.num_samples
