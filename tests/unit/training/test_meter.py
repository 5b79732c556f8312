"""training/meter.py: a step's counts, each batch once over the processes, and the trackers' flat config."""

import torch

from memrecipe.training.meter import flat_config, window_counts


def test_a_windows_counts_are_summed_over_processes_and_each_tensor_parallel_batch_once():
    window = [{"input_ids": torch.zeros(2, 6), "attention_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2])},
              {"input_ids": torch.zeros(1, 4), "attention_mask": torch.ones(1, 4)}]
    counts, local = window_counts(window, targets=24, reduce=lambda t: 2 * t)  # two processes, the same batches
    assert local == 14 and counts == {"targets": 24, "tokens": 28, "slots": 32}
    shared, _ = window_counts(window, targets=24, reduce=lambda t: 2 * t, tp_size=2)  # one tp group of 2 ranks
    assert shared == {"targets": 12, "tokens": 14, "slots": 16}


def test_the_trackers_take_the_recipe_as_flat_scalars():
    assert flat_config({"lora": {"r": 8, "target_modules": ["q_proj"]}, "seed": 1}) == {
        "lora.r": 8, "lora.target_modules": "['q_proj']", "seed": 1}
