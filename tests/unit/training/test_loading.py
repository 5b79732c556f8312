"""training/loading.py: the base as the recipe says it is held (a LoRA base in the compute dtype, trained weights in
the recipe's weight dtype), no KV cache; the ranks FSDP2 broadcasts to build it without its weights; a model that
cannot be read is one line naming the cause."""

import pytest
import torch

from memrecipe.errors import RecipeError
from memrecipe.planning.registry import load_recipe
from memrecipe.training.loading import check_model, embedded_model, load_pretrained, rank0_loads, without_weights


@pytest.mark.parametrize("recipe, precision, dtype", [
    ("single-gpu-lora", "bf16", torch.bfloat16),  # a frozen LoRA base in the compute dtype: 2 bytes/param
    ("adamw-8bit", "bf16", torch.float32),  # fp32 masters, autocast computes in bf16
    ("single-gpu-full", "bf16", torch.bfloat16),  # the recipe trains bf16 weights
    ("single-gpu-lora", "no", torch.float32),
])
def test_the_base_is_held_in_the_dtype_the_recipe_plans(recipe, precision, dtype):
    model = load_pretrained(load_recipe(recipe), embedded_model(), precision)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.config.use_cache is False and model.memrecipe_attention.name == "sdpa"


def test_only_the_ranks_fsdp2_broadcasts_to_build_the_model_without_weights(monkeypatch):
    fsdp = load_recipe("fsdp")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    monkeypatch.setenv("RANK", "1")
    assert rank0_loads(fsdp) and not rank0_loads(load_recipe("zero3-offload"))
    monkeypatch.setenv("RANK", "0")  # rank 0 reads the checkpoint
    assert not rank0_loads(fsdp)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    assert not rank0_loads(fsdp)


def test_a_model_built_without_weights_has_their_shapes_real_buffers_and_its_ties():
    real = load_pretrained(load_recipe("adamw-8bit"), embedded_model(), "bf16")
    empty = without_weights(embedded_model(), torch.float32, "sdpa", False)
    assert [(n, p.shape, p.device.type) for n, p in empty.named_parameters()] == \
           [(n, p.shape, "cpu") for n, p in real.named_parameters()]
    for (name, mine), (_, theirs) in zip(empty.named_buffers(), real.named_buffers()):  # rotary frequencies
        assert torch.equal(mine, theirs), name
    if real.config.tie_word_embeddings:
        assert empty.lm_head.weight is empty.model.embed_tokens.weight


@pytest.mark.parametrize("path, reason", [
    ("./no/such/model", "model path ./no/such/model does not exist"),
    ("nobody/no-such-model-here", "is neither a local folder nor reachable on the hub"),
])
def test_a_model_that_cannot_be_read_is_one_line(path, reason):
    with pytest.raises(RecipeError, match=reason):
        check_model(path)


def test_rope_scaling_is_written_into_the_config_the_model_is_built_and_saved_with(tmp_path):
    """rope_scaling (YaRN x2 from the model's 512 positions, by default from max_seq_length's ratio): the rotary
    frequencies are built scaled, and the saved model's config.json carries them; without it, the model's own RoPE."""
    from transformers import AutoModelForCausalLM

    plain = load_pretrained(load_recipe("single-gpu-lora", ["max_seq_length=1024"]), embedded_model(), "no")
    scaled = load_pretrained(load_recipe("single-gpu-lora", ["max_seq_length=1024", "rope_scaling.rope_type=yarn"]),
                             embedded_model(), "no")
    assert plain.config.rope_parameters["rope_type"] == "default" and plain.config.max_position_embeddings == 512
    assert scaled.config.rope_parameters == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512,
                                             "rope_theta": 10000.0}
    assert scaled.config.max_position_embeddings == 1024
    a, b = (m.model.rotary_emb for m in (plain, scaled))
    assert not torch.equal(a.inv_freq, b.inv_freq) and b.attention_scaling > a.attention_scaling == 1.0  # YaRN's
    scaled.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reloaded.model.rotary_emb.inv_freq, b.inv_freq)
