"""registry.py: a recipe found by name or file, its `base:` chain merged, `key=value` overrides applied, and a saved
adapter as the model turned into its base plus lora.adapter."""

import dataclasses
import re

import pytest
import yaml

from memrecipe.errors import RecipeError
from memrecipe.planning.recipe import make_recipe
from memrecipe.planning.registry import load_recipe


def test_overrides_are_dotted_and_parsed_as_yaml():
    r = load_recipe("single-gpu-lora", ["lora.r=8", "lora.target_modules=[q_proj,v_proj]", "max_steps=10",
                                        "learning_rate=1e-4", "save_steps=null"])
    assert r.lora.r == 8 and r.lora.target_modules == ("q_proj", "v_proj")
    assert r.max_steps == 10 and r.learning_rate == pytest.approx(1e-4) and r.save_steps is None
    assert r.lora.alpha == 32  # untouched sibling keys keep the recipe's values
    assert load_recipe("single-gpu-lora", ["lora=null"]).lora is None
    # a dotted key into a null section creates it with defaults
    assert load_recipe("fsdp", ["fsdp.activation_checkpointing=false", "lora.r=4", "gradient_checkpointing=true"]).lora.r == 4


def test_bare_no_in_yaml_means_the_choice_no():
    assert load_recipe("fsdp", ["mixed_precision=no"]).mixed_precision == "no"


def test_unknown_recipe_and_missing_file():
    with pytest.raises(RecipeError, match="did you mean 'fsdp'"):
        load_recipe("fsdpp")
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe("nowhere/recipe.yaml")


def test_a_recipe_with_a_base_changes_only_what_it_names(tmp_path):
    """`base:` starts from a shipped recipe (or a file beside this one): sections merge key by key, null
    turns a section off, name defaults to the file's stem, supports and distributed_type come from the base."""
    (tmp_path / "mine.yaml").write_text("base: fsdp-lora\nmax_steps: 5\nlora: {r: 8}\n")
    mine, base = load_recipe(str(tmp_path / "mine.yaml")), load_recipe("fsdp-lora")
    assert mine.name == "mine" and mine.max_steps == 5
    assert mine.lora == dataclasses.replace(base.lora, r=8) and base.lora.r != 8  # alpha, dropout, targets kept
    assert (mine.supports, mine.distributed_type, mine.fsdp) == (base.supports, base.distributed_type, base.fsdp)
    # a file based on that file: chains, relative to the file that names it; null replaces a whole section
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "full.yaml").write_text("base: ../mine.yaml\nname: full-ft\nlora: null\n")
    full = load_recipe(str(tmp_path / "sub" / "full.yaml"), ["learning_rate=1e-4"])
    assert full.name == "full-ft" and full.lora is None and full.max_steps == 5 and full.learning_rate == 1e-4
    assert make_recipe(yaml.safe_load(full.to_yaml())) == full  # what a run folder stores: resolved, no base


@pytest.mark.parametrize("text, reason", [
    ("base: single-gpu-lora\nmax_stepz: 5\n", "unknown key 'max_stepz' (did you mean 'max_steps'?)"),
    ("base: single-gpu-lorra\n", "base: unknown recipe 'single-gpu-lorra' (did you mean 'single-gpu-lora'?)"),
    ("base: loop.yaml\n", "base loop.yaml leads back to loop.yaml"),
    ("base: [fsdp]\n", "base must be a recipe name or a recipe file"),
    ("base: single-gpu-lora\nlora: {rank: 8}\n", "unknown key 'lora.rank' (did you mean 'lora.r'?)"),
])
def test_a_bad_base_recipe_is_one_line_naming_what_is_wrong(tmp_path, text, reason):
    (tmp_path / "loop.yaml").write_text(text)
    with pytest.raises(RecipeError, match=re.escape(reason)):
        load_recipe(str(tmp_path / "loop.yaml"))


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
