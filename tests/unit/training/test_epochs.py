"""Epochs end alike on every topology: for one global batch (micro batch x accumulation x processes) and seed,
every optimizer step of every epoch trains the same rows, whichever way the global batch is split, and the
epoch's last partial global batch is left out everywhere (a new draw each epoch), never topped up with repeats.

The loop's own train loader (recipes/sft.py `train_loader`) sharded by accelerate's own prepare_data_loader for
each process in turn; the losses of whole runs on each engine: tests/runs/test_engines_agree.py."""

import sys

import pytest
from accelerate.data_loader import prepare_data_loader

from helpers import REPO
from memrecipe.planning.registry import load_recipe

sys.path.insert(0, str(REPO / "recipes"))
from sft import train_loader, windows  # noqa: E402  (the loop's own)

SEED = 7


def steps(rows: int, processes: int, micro: int, accumulation: int, epochs: int = 2) -> list[list[list[int]]]:
    """Per epoch, per optimizer step: the rows it trains (over all processes), sorted."""
    recipe = load_recipe("ddp", [f"per_device_train_batch_size={micro}", f"gradient_accumulation_steps={accumulation}",
                                 f"seed={SEED}"])
    data = [{"row": i} for i in range(rows)]
    shards = [prepare_data_loader(train_loader(recipe, data, lambda examples: [e["row"] for e in examples]),
                                  num_processes=processes, process_index=rank, put_on_device=False,
                                  use_seedable_sampler=True, data_seed=SEED) for rank in range(processes)]
    out = []
    for epoch in range(epochs):
        per_process = []
        for shard in shards:
            shard.set_epoch(epoch)
            per_process.append([[row for batch in window for row in batch] for window in windows(shard, accumulation)])
        assert len({len(p) for p in per_process}) == 1  # every process takes the same number of steps
        out.append([sorted(row for p in step for row in p) for step in zip(*per_process)])
    return out


@pytest.mark.parametrize("rows", [38, 305], ids=["packed-38-rows", "unpacked-305-examples"])
def test_every_split_of_a_global_batch_trains_the_same_rows_in_every_step(rows):
    one = steps(rows, 1, 4, 2)  # global batch 8, split four ways below
    for processes, micro, accumulation in ((2, 2, 2), (2, 4, 1), (4, 1, 2), (8, 1, 1)):
        assert steps(rows, processes, micro, accumulation) == one, (processes, micro, accumulation)
    left_out = []
    for epoch in one:
        trained = [row for step in epoch for row in step]
        assert len(epoch) == rows // 8 and all(len(step) == 8 for step in epoch)
        assert len(set(trained)) == len(trained) == rows // 8 * 8  # no row twice in an epoch
        left_out.append(set(range(rows)) - set(trained))
    assert one[0] != one[1] and left_out[0] != left_out[1]  # a new shuffle, and a new draw left out, each epoch
