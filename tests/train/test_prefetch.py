"""The background prefetch of micro-batches hands over exactly the sequence the loader defines, and its errors."""

import threading

import pytest
import torch

from diffusion_pipe.train.data import Prefetcher


class Numbered:
    """A loader whose batch at each position is a pure function of it (as MicroBatches' is)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.threads: set[str] = set()

    def at(self, position: int):
        self.threads.add(threading.current_thread().name)
        if position == self.fail_at:
            raise KeyError(f"entry of position {position} is missing")
        return (torch.full((2,), float(position)), [torch.tensor(position)]), (torch.ones(1) * position, None)


def test_same_sequence_as_the_loader_and_counts_what_it_handed_over():
    source = Numbered()
    loader = Prefetcher(source, torch.device("cpu"), position=5, depth=3)
    try:
        for expected in range(5, 12):
            (x, [y]), (label, nothing) = next(loader)
            assert x.tolist() == [expected, expected] and int(y) == expected and float(label) == expected
            assert nothing is None
            assert loader.position == expected + 1  # what a checkpoint records: the next batch to train on
    finally:
        loader.close()
    assert all(name.startswith("train-data") for name in source.threads)  # prepared off the training thread


def test_a_failing_batch_raises_in_the_training_thread():
    loader = Prefetcher(Numbered(fail_at=2), torch.device("cpu"))
    try:
        next(loader)
        next(loader)
        with pytest.raises(KeyError, match="entry of position 2 is missing"):
            next(loader)
    finally:
        loader.close()
