"""training/meta.py: a model's structure read off its real modules on the meta device (no memory), for the families
the planner has no reader of its own, and the tensors peft's LoRA trains on it."""

from pathlib import Path

import pytest

from memrecipe.errors import RecipeError
from memrecipe.planning.architecture import structure
from model_configs import SMALL


@pytest.mark.parametrize("kind", ["starcoder2", "helium", "cohere", "olmo", "glm", "mixtral", "qwen2_moe"])
def test_other_families_are_read_off_their_real_modules(kind):
    """Families whose hand count was wrong (starcoder2's plain MLP counted as gated, helium's default head_dim
    not applied, cohere's and olmo's norms, glm's fused MLP) or that route tokens to experts: their counts are
    those of the model transformers builds."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(kind, **SMALL)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # as loading does (skipped on the meta device)
    s = structure(config.to_dict())
    assert s.params == sum(p.numel() for p in model.parameters())
    assert s.head_dim == (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    assert (s.experts > 0) == (kind in ("mixtral", "qwen2_moe"))


def test_an_unknown_model_type_is_named_in_one_whole_sentence():
    """transformers follows an unknown model type with every known one: the line keeps its first sentence, whole."""
    from memrecipe.training.meta import first_sentence, structure_from_meta

    with pytest.raises(RecipeError) as refused:
        structure_from_meta({"model_type": "no_such_model_type_" + "x" * 150})
    said = str(refused.value)
    assert said.endswith("x)") and "Should contain" not in said
    assert first_sentence("alpha beta gamma. Delta", limit=12) == "alpha beta ..."


def test_the_lora_tensors_read_on_the_meta_device_are_those_peft_trains_on_the_real_model():
    import json
    from dataclasses import replace

    import torch
    from transformers import AutoModelForCausalLM

    from memrecipe.planning.registry import load_recipe
    from memrecipe.training.adapters import add_lora
    from memrecipe.training.loading import embedded_model
    from memrecipe.training.meta import lora_tensors

    lora = replace(load_recipe("single-gpu-lora").lora, r=4, target_modules=("q_proj", "down_proj"))
    config = json.loads((Path(embedded_model()) / "config.json").read_text())
    on_meta = lora_tensors(json.dumps(config), lora)
    real = add_lora(AutoModelForCausalLM.from_pretrained(embedded_model(), dtype=torch.float32), lora)
    trained = [(n.rsplit(".", 1)[0], tuple(p.shape)) for n, p in real.named_parameters() if p.requires_grad]
    assert [(t.name, t.shape) for t in on_meta] == trained and len(trained) == 4 * config["num_hidden_layers"]
