"""planning/rules.py: combinations of keys that cannot work are refused with the reason, and those that can are not."""

import pytest

from memrecipe.errors import RecipeError
from memrecipe.planning.registry import load_recipe


@pytest.mark.parametrize("recipe, override, reason", [
    ("fsdp", ["optim=adamw_bnb_8bit"], "bitsandbytes cannot update DTensor state"),
    ("zero3-offload", ["optim=adamw_bnb_8bit"], "DeepSpeed's offload runs its own CPU Adam"),
    ("fsdp", ["lora.r=8"], "EMPTY adapter"),
    ("fsdp", ["gradient_checkpointing=true"], "keep one"),
    ("zero3-offload", ["deepspeed.zero_stage=2"], "offload_param needs zero_stage 3"),
    ("single-gpu-lora", ["fsdp.version=2"], "only read with distributed_type fsdp"),
    ("single-gpu-lora", ["supports.max_processes=4"], "distributed_type no runs one process"),
    ("qlora", ["lora=null"], "add a lora: section"),
    ("zero3-offload", ["quantization.bits=4", "lora.r=8"], "not supported with DeepSpeed"),
    ("fsdp", ["quantization.bits=4", "lora.r=8", "fsdp.activation_checkpointing=false"], "fsdp.version=1"),
    ("ddp", ["activation_offload=true"], "set gradient_checkpointing=true"),
    ("fsdp", ["activation_offload=true"], "set gradient_checkpointing=true fsdp.activation_checkpointing=false"),
])
def test_incompatible_combinations_are_refused_with_the_reason(recipe, override, reason):
    with pytest.raises(RecipeError, match=reason):
        load_recipe(recipe, override)


def test_fsdp1_takes_an_8bit_optimizer():
    # bitsandbytes works on FSDP1's flat parameters (measured); only FSDP2's DTensors are refused
    assert load_recipe("fsdp", ["fsdp.version=1", "optim=adamw_bnb_8bit"]).uses_bnb
