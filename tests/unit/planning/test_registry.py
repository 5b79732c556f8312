"""planning/registry.py: a recipe found by name or file, its `base:` chain merged, `key=value` overrides applied, and
the embedded model's own settings (a saved adapter as the model: test_saved_adapter.py)."""

import dataclasses
import re

import pytest
import yaml

from helpers import REPO
from memrecipe.errors import RecipeError
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.rules import make_recipe


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


RECIPE_FILES = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.stem)
def test_every_shipped_recipe_holds_a_real_models_numbers(path):
    """What a recipe file says is what a real model needs (the embedded model's own settings live in the library):
    LoRA at most 3e-4, a full fine-tune at most 5e-5, rows of at least 1024 tokens."""
    data = yaml.safe_load(path.read_text())
    assert data["learning_rate"] <= (3e-4 if data.get("lora") else 5e-5), path.name
    assert isinstance(data["max_seq_length"], int) and data["max_seq_length"] >= 1024, path.name


def test_the_embedded_model_trains_at_its_own_settings_and_a_real_one_at_the_recipes(tmp_path):
    """Its own learning rate, rows and epochs when it is the model (the README's main job learns in seconds); the
    recipe's when a model is named; key=value overrides win over both. The resolved recipe (a run folder's) loads
    back to the same numbers, with or without an override in it."""
    for name, rate in (("single-gpu-lora", 5e-3), ("qlora", 5e-3), ("fsdp", 1e-3), ("zero3-offload", 1e-3)):
        small, real = load_recipe(name), load_recipe(name, ["model_name_or_path=org/model"])
        assert (small.learning_rate, small.max_seq_length, small.num_train_epochs) == (rate, 256, 3)
        assert (real.learning_rate, real.max_seq_length, real.num_train_epochs) == \
            (yaml.safe_load((RECIPE_FILES[0].parent / f"{name}.yaml").read_text())["learning_rate"], 2048, 1)
    mine = load_recipe("single-gpu-lora", ["learning_rate=1e-2", "max_seq_length=128"])
    assert (mine.learning_rate, mine.max_seq_length, mine.num_train_epochs) == (1e-2, 128, 3)
    for recipe in (mine, load_recipe("fsdp")):
        (tmp_path / "recipe.yaml").write_text(recipe.to_yaml())
        assert load_recipe(str(tmp_path / "recipe.yaml")) == recipe


def test_the_start_up_line_says_which_of_the_embedded_models_settings_a_run_trains_at():
    """docs/configs.md: key=value overrides win, "and the start-up line says so"; so does a recipe's
    embedded_settings false (which keeps its real-model numbers for the tiny model)."""
    from memrecipe.planning.registry import embedded_settings_said

    assert embedded_settings_said(load_recipe("single-gpu-lora")) == (
        "at its own settings: learning_rate 0.005, max_seq_length 256, 3 epochs (the recipe's numbers are a real "
        "model's: --model gives them)")
    said = embedded_settings_said(load_recipe("single-gpu-lora", ["learning_rate=1e-4"]))
    assert said.startswith("at learning_rate 0.0001, max_seq_length 256, 3 epochs: not its own learning_rate 0.005,")
    kept = embedded_settings_said(load_recipe("fsdp", ["embedded_settings=false"]))
    assert "not its own learning_rate 0.001, max_seq_length 256, num_train_epochs 3" in kept


def test_run_dpo_trains_at_a_preference_tuning_rate():
    """run dpo's rate is dpo.learning_rate (alignment-handbook's: LoRA 5e-6, full 5e-7), not SFT's; a
    `learning_rate=` word under run dpo sets it; the embedded model keeps its own rate under DPO too."""
    real = ["model_name_or_path=org/model"]
    for name, rate in (("single-gpu-lora", 5e-6), ("fsdp", 5e-7)):
        r = load_recipe(name, real, script="dpo")
        assert r.learning_rate == r.dpo.learning_rate == rate
    r = load_recipe("qlora", [*real, "learning_rate=2e-5"], script="dpo")
    assert r.learning_rate == r.dpo.learning_rate == 2e-5
    assert load_recipe("qlora", [*real, "learning_rate=2e-5"], script="sft").learning_rate == 2e-5
    assert load_recipe("single-gpu-lora", script="dpo").learning_rate == 5e-3


def test_dpo_rows_never_exceed_what_the_plan_counts():
    """A pair's chosen and rejected share a row: 2 x dpo.max_length above max_seq_length is refused, naming the key."""
    with pytest.raises(RecipeError, match=r"dpo.max_length=200 .* above max_seq_length=256 .* <= 128"):
        load_recipe("single-gpu-lora", ["dpo.max_length=200"], script="dpo")
    assert load_recipe("single-gpu-lora", ["dpo.max_length=128"], script="dpo").dpo.max_length == 128
    with pytest.raises(RecipeError, match="dpo.max_length=2048"):
        load_recipe("qlora", ["model_name_or_path=org/model", "dpo.max_length=2048"], script="dpo")


def test_words_that_switch_the_method_switch_the_learning_rate_unless_they_name_one(cli):
    """lora.r=16 on a full fine-tune (zero3-ulysses, 1e-5) trains at the LoRA recipes' 2e-4, and lora=null on a LoRA
    recipe at the full fine-tunes' 2e-5, each said before the launch; a learning_rate word wins; the shipped recipes
    train at the rates the table names."""
    from memrecipe.planning.registry import METHOD_LEARNING_RATE, data_dir

    real = ["model_name_or_path=/models/llama"]
    assert load_recipe("zero3-ulysses", real).learning_rate == 1e-5  # as written: its own, for a full fine-tune
    assert load_recipe("zero3-ulysses", [*real, "lora.r=16"]).learning_rate == 2e-4
    assert load_recipe("zero3-offload", [*real, "lora.r=8"]).learning_rate == 2e-4
    assert load_recipe("zero3-ulysses", [*real, "lora.r=16", "learning_rate=1e-4"]).learning_rate == 1e-4
    assert load_recipe("single-gpu-lora", [*real, "lora=null"]).learning_rate == 2e-5
    assert load_recipe("single-gpu-lora", [*real, "lora.r=4"]).learning_rate == 2e-4  # (LoRA still: its own)
    for path in data_dir("recipes").glob("*.yaml"):
        r = load_recipe(str(path), real)
        if r.lora is not None:
            assert r.learning_rate == METHOD_LEARNING_RATE["lora"], path.name
    done = cli("run", "sft", "--recipe", "zero3-ulysses", "--cpu", "--num-processes", "1", "lora.r=16", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "note: learning_rate 0.0002: the words make zero3-ulysses a LoRA run" in done.stdout + done.stderr


def test_one_plan_parses_each_recipe_file_once(monkeypatch, tmp_path):
    """A plan over 8 GPUs loads every shipped recipe (and its `base:` chain) for each recipe whose topology it checks:
    180 YAML parses for one 70B plan, now one per file; and a file changed between two loads is read anew."""
    from click.testing import CliRunner

    from memrecipe.commands import plan
    from memrecipe.planning import registry

    parsed = []
    real = yaml.safe_load
    monkeypatch.setattr(registry.yaml, "safe_load", lambda text: parsed.append(text) or real(text))
    registry.parse_yaml.cache_clear()
    out = CliRunner().invoke(plan.command, ["--gpu-memory", "80GB", "--num-processes", "8"])
    assert out.exit_code == 0, out.output
    files = {registry.recipe_path(name).read_text() for name in registry.recipe_names()}
    read = [text for text in parsed if text in files]  # (override words are YAML too)
    assert len(read) == len(set(read)) >= len(files) // 2  # (each once; the plan reads most of them)
    mine = tmp_path / "mine.yaml"
    mine.write_text("base: single-gpu-lora\nsave_total_limit: 3\n")
    assert load_recipe(str(mine)).save_total_limit == 3
    mine.write_text("base: single-gpu-lora\nsave_total_limit: 5\n")
    assert load_recipe(str(mine)).save_total_limit == 5
