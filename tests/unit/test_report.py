"""The report card's pure parts: MFU's peak table and FLOPs, the advice line."""

import pytest

from memrecipe.report import advice, bf16_peak, flops_per_token


def test_peak_table_matches_device_names_and_refuses_unknown_ones():
    assert bf16_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert bf16_peak("NVIDIA H100 PCIe") == 756e12
    assert bf16_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert bf16_peak("NVIDIA A10G") == 70e12
    assert bf16_peak("Tesla V100-SXM2-16GB") is None  # no bf16: no MFU rather than a wrong one
    assert bf16_peak(None) is None


def test_flops_are_6n_for_full_and_4n_for_lora_plus_attention():
    n, layers, hidden, seq = 1_000_000, 4, 128, 256
    attention = 12 * layers * hidden * seq
    assert flops_per_token(n, n, layers, hidden, seq) == 6 * n + attention
    assert flops_per_token(n, 1000, layers, hidden, seq) == 4 * n + 2 * 1000 + attention


def _report(peak_reserved, **recipe):
    base = {"name": "adamw-8bit", "per_device_train_batch_size": 4, "gradient_checkpointing": False,
            "distributed_type": "ddp", "fsdp": None, "deepspeed": None}
    return {"recipe": base | recipe, "processes": [{"cuda_max_reserved_bytes": peak_reserved}]}


@pytest.mark.parametrize("peak, recipe, words", [
    (10e9, {}, "raise per_device_train_batch_size to 12"),
    (75e9, {}, "turn on gradient_checkpointing"),
    (75e9, {"gradient_checkpointing": True}, "shard the model states"),
    (75e9, {"gradient_checkpointing": True, "distributed_type": "fsdp"}, "offload to CPU next"),
    (75e9, {"gradient_checkpointing": True, "distributed_type": "deepspeed", "deepspeed": {"offload_optimizer": "cpu"}},
     "lower max_seq_length"),
    (65e9, {}, "fits with room to spare"),
])
def test_advice_follows_the_tuning_flow(peak, recipe, words):
    assert words in advice(_report(peak, **recipe), 80e9, bigger_micro_batch=12)


def test_advice_on_cpu_points_to_the_planner():
    """With the run folder's resolved recipe: a user's recipe file named `my` is no shipped recipe name."""
    said = advice(_report(0, name="my") | {"output_dir": "/runs/my-1"}, None, None)
    assert "`memrecipe plan --recipe /runs/my-1/recipe.yaml --model MODEL --gpu-memory 80GB`" in said


def test_advice_after_the_embedded_model_plans_the_shipped_recipe_for_a_real_one():
    """The run folder's recipe holds the embedded model's own settings (256-token rows): for a real model the plan
    starts from the shipped recipe's numbers instead."""
    said = advice(_report(0, model_name_or_path=None) | {"output_dir": "/runs/adamw-8bit-1"}, None, None)
    assert "`memrecipe plan --recipe adamw-8bit --model MODEL --gpu-memory 80GB`" in said
