"""planning/optimizers.py: the optimizer table, what each entry allows where, and how updates reach bf16 weights.
The optimizers built and measured against the plan: tests/unit/training/test_optimizers.py."""

import pytest

from memrecipe.errors import RecipeError
from memrecipe.planning.optimizers import bf16_rounding
from memrecipe.planning.registry import load_recipe

IN_BACKWARD = ["optimizer_in_backward=true", "max_grad_norm=null", "gradient_accumulation_steps=1"]


@pytest.mark.parametrize("overrides, rounding", [
    ([], "stochastically"),  # single-gpu-full: torchao's 8-bit AdamW, bf16_stochastic_round
    (["optim=adamw_bnb_8bit"], "to nearest"),  # the choice without torchao's compile
    (["optim_args.bf16_stochastic_round=false"], "to nearest"),
    (["optim=apollo_adamw"], "to nearest"),
    (["weight_dtype=fp32"], None),  # fp32 masters: nothing to round
])
def test_how_updates_reach_bf16_weights_is_the_recipes_choice(overrides, rounding):
    assert bf16_rounding(load_recipe("single-gpu-full", overrides)) == rounding
    assert bf16_rounding(load_recipe("single-gpu-lora")) is None  # LoRA: a frozen base, fp32 adapters


@pytest.mark.parametrize("recipe, overrides, words", [
    ("ddp", IN_BACKWARD, ["optimizer_in_backward runs on one process", "distributed_type no"]),
    ("fsdp", ["optim=apollo_adamw"], ["apollo_adamw", "shards", "ddp"]),
    ("zero3-offload", ["optim=adamw_torch_8bit"], ["adamw_torch_8bit", "distributed_type no or ddp"]),
    ("single-gpu-lora", ["optim=apollo_adamw"], ["low-rank", "lora=null"]),
    ("single-gpu-lora", ["weight_dtype=bf16"], ["weight_dtype", "full fine-tuning"]),
    ("fsdp", ["weight_dtype=bf16"], ["weight_dtype bf16", "FSDP"]),
    ("ddp", ["optim=apollo", ], ["optim must be one of", "apollo_adamw"]),
    ("ddp", ["optim_args.rnak=8"], ["optim_args.rnak", "optim_args.rank"]),
])
def test_optimizer_choices_are_refused_where_they_cannot_run(recipe, overrides, words):
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe, overrides)
    assert all(w in str(e.value) for w in words), str(e.value)
