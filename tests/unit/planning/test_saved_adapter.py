"""planning/saved_adapter.py: a saved LoRA adapter as the model trains on, with its own shape, on its base."""

import re

import pytest

from memrecipe.errors import RecipeError
from memrecipe.planning.registry import load_recipe


def test_a_saved_adapter_as_the_model_trains_on_with_its_own_shape_on_its_base(tmp_path):
    """`--model runs/<sft>/final` (a LoRA adapter: adapter_config.json, no config.json): the recipe's lora: takes
    the adapter's r, alpha and targets (what its weights are; dropout stays the recipe's), lora.adapter points at the
    folder, and the model becomes the adapter's base; named as lora.adapter, the recipe's model stays. A full
    fine-tune, a non-LoRA adapter and a folder that holds no adapter are refused in one line."""
    import json

    adapter = tmp_path / "run" / "final"
    adapter.mkdir(parents=True)
    (tmp_path / "run" / "report.json").write_text("{}")
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["v_proj", "q_proj"], "use_dora": False,
        "bias": "none", "base_model_name_or_path": "meta-llama/Llama-3.1-8B", "lora_dropout": 0.3}))
    r = load_recipe("single-gpu-lora", [f"model_name_or_path={adapter}", "lora.dropout=0"])
    assert r.model_name_or_path == "meta-llama/Llama-3.1-8B" and r.lora.adapter == str(adapter)
    assert (r.lora.r, r.lora.alpha, r.lora.target_modules, r.lora.dropout) == (4, 8.0, ("q_proj", "v_proj"), 0.0)
    assert load_recipe("single-gpu-lora", [f"model_name_or_path={r.model_name_or_path}",
                                           f"lora.adapter={adapter}", "lora.dropout=0"]) == r  # what the run folder's recipe.yaml says
    named = load_recipe("single-gpu-lora", [f"lora.adapter={adapter}"])
    assert named.model_name_or_path is None and named.lora.r == 4  # the embedded model, the adapter named
    with pytest.raises(RecipeError, match=re.escape(f"{adapter} is a LoRA adapter, and this recipe fine-tunes a whole "
                                                    f"model: memrecipe export {adapter.parent} {adapter.parent}-merged "
                                                    "--merge")):
        load_recipe("single-gpu-full", [f"model_name_or_path={adapter}"])
    with pytest.raises(RecipeError, match="lora.adapter .* is no saved adapter's folder"):
        load_recipe("single-gpu-lora", [f"lora.adapter={tmp_path}"])
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3", "base_model_name_or_path": "x"}))
    with pytest.raises(RecipeError, match="holds a IA3 adapter: memrecipe trains LoRA adapters on"):
        load_recipe("single-gpu-lora", [f"model_name_or_path={adapter}"])
