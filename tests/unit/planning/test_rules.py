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
    ("fsdp-lora", ["fsdp.version=1"], "fsdp.version=1 with LoRA needs fsdp.use_orig_params=false"),
    ("fsdp-qlora", ["lora.bias=all"], "lora.bias=all under fsdp.version=1: a trained bias would sit in its frozen"),
    ("ddp", ["activation_offload=true"], "set gradient_checkpointing=true"),
    ("fsdp", ["activation_offload=true"], "set gradient_checkpointing=true fsdp.activation_checkpointing=false"),
    # Ulysses: DeepSpeed's ZeRO-3 only, whole sequences causal by position (no mask), no compile, one split at a time
    ("fsdp-lora", ["parallelism.sp_size=2"], r"accelerate runs on DeepSpeed only \(sp_backend deepspeed\): use the "
                                             "zero3-ulysses recipe, or set parallelism.sp_size=1"),
    ("zero3-ulysses", ["deepspeed.zero_stage=2", "deepspeed.offload_optimizer=none"],
     r"parallelism.sp_size runs on ZeRO-3 in memrecipe \(stage 2 averages gradients over another group"),
    ("zero3-ulysses", ["packing=true"], "under sdpa a packed row's documents would attend to each other: set "
                                        "packing=false"),
    ("zero3-ulysses", ["attn_implementation=eager"], "accelerate refuses eager and flex_attention there"),
    ("zero3-ulysses", ["attn_implementation=flex_attention"], "set attn_implementation=sdpa"),
    ("zero3-ulysses", ["torch_compile=true"], "torch_compile"),
    ("tp", ["parallelism.sp_size=2"], "parallelism.tp_size=2 and parallelism.sp_size=2: one way of splitting at a time"),
])
def test_incompatible_combinations_are_refused_with_the_reason(recipe, override, reason):
    with pytest.raises(RecipeError, match=reason):
        load_recipe(recipe, override)


def test_fsdp1_takes_an_8bit_optimizer():
    # bitsandbytes works on FSDP1's flat parameters (measured); only FSDP2's DTensors are refused
    assert load_recipe("fsdp", ["fsdp.version=1", "optim=adamw_bnb_8bit"]).uses_bnb


def test_ulysses_takes_packed_rows_with_flash_attention_and_one_process():
    """flash_attention_2 reads a packed row's documents from the gathered positions; sp_size 1 is no split at all, and
    a parallelism: section with only sp_size means tp_size 1."""
    packed = load_recipe("zero3-ulysses", ["packing=true", "attn_implementation=flash_attention_2"])
    assert packed.packing and packed.sequence_parallel is None and packed.tensor_parallel == 1
    one = load_recipe("zero3-offload", ["parallelism.sp_size=1"])
    assert (one.sequence_parallel, one.tensor_parallel) == (1, 1)


def test_a_topology_the_group_does_not_divide_is_refused_and_null_becomes_all_the_processes():
    from memrecipe.planning.topology import Topology, check_supported, decide

    with pytest.raises(RecipeError, match="splits each sequence over parallelism.sp_size=4 processes: --num-processes "
                                          "must be a multiple of 4, got 6"):
        check_supported(load_recipe("zero3-ulysses", ["parallelism.sp_size=4"]), Topology(6))
    decided = decide(load_recipe("zero3-ulysses"), Topology(8))
    assert decided.sequence_parallel == 8 and decide(load_recipe("zero3-offload"), Topology(8)).parallelism is None
