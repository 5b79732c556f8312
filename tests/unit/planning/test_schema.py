"""planning/schema.py: a recipe's dict built into its dataclasses, each bad value refused in one line naming the key and
what would be right; defaults are the dataclasses' own."""

import pytest

from memrecipe.errors import RecipeError
from memrecipe.planning.recipe import Recipe
from memrecipe.planning.registry import load_recipe, parse_overrides
from memrecipe.planning.rules import make_recipe


@pytest.mark.parametrize("override, words", [
    (["lora.rr=8"], ["lora.rr", "did you mean 'lora.r'"]),
    (["learning_rat=1e-4"], ["learning_rat", "did you mean 'learning_rate'"]),
    (["beta=0.2"], ["unknown key 'beta' (did you mean 'dpo.beta'?)"]),  # a section's key outside its section
    (["zero_stage=3"], ["did you mean 'deepspeed.zero_stage'?"]),
    (["deepspeed.r=3"], ["unknown key 'deepspeed.r'; allowed here: zero_stage"]),  # ('r' is like no key of its own)
    (["optim=adamw"], ["optim must be one of", "adamw_torch"]),
    (["lora.r=0"], ["lora.r must be >= 1 and <= 4096", "got 0"]),
    (["per_device_train_batch_size=two"], ["per_device_train_batch_size must be an integer", "'two'"]),
    (["gradient_checkpointing=maybe"], ["gradient_checkpointing must be true or false"]),
    (["max_seq_length=2.5"], ["max_seq_length must be an integer"]),
    (["learning_rate=-1"], ["learning_rate must be > 0"]),
    (["lora.dropout=1.5"], ["lora.dropout must be >= 0 and <= 0.99"]),
    (["warmup_steps=10", "warmup_ratio=0.1"], ["warmup_steps or warmup_ratio"]),
    (["max_steps"], ["not key=value"]),
    (["lora.target_modules=[q_proj"], ["not valid YAML"]),
])
def test_bad_values_are_refused_naming_the_key(override, words):
    with pytest.raises(RecipeError) as e:
        load_recipe("single-gpu-lora", override)
    for w in words:
        assert w in str(e.value)
    assert "\n" not in str(e.value)


def test_a_recipe_file_needs_a_name(tmp_path):
    with pytest.raises(RecipeError, match="missing required key 'name'"):
        make_recipe({"learning_rate": 1e-3})


def test_recipe_defaults_are_the_dataclass_defaults():
    r = make_recipe({"name": "x", "supports": {"max_processes": 1}})
    assert r == Recipe(name="x", supports=r.supports)
    assert parse_overrides(["a.b.c=1"]) == {"a": {"b": {"c": 1}}}
