"""planning/recipe.py: every shipped recipe validates and says what it saves, every memory knob carries its trade-off,
a Recipe is immutable and round-trips through YAML (types and ranges: test_schema.py; refused combinations:
test_rules.py; lookup, `base:` and overrides: test_registry.py)."""

import dataclasses

import pytest
import yaml

from memrecipe.planning.registry import load_recipe, recipe_names, recipe_path
from memrecipe.planning.rules import make_recipe

SHIPPED = ["adamw-8bit", "fsdp", "single-gpu-lora", "zero3-offload"]
ALL = SHIPPED + ["qlora", "fsdp-lora", "fsdp-qlora", "zero2", "ddp", "tp", "single-gpu-full", "zero3-ulysses"]


def test_the_four_recipes_are_shipped_and_valid():
    assert set(SHIPPED) <= set(recipe_names())
    for name in SHIPPED:
        r = load_recipe(name)
        assert r.name == name
        text = recipe_path(name).read_text()
        assert "memrecipe run sft --recipe " + name in text and "accelerate launch --config_file" in text


def test_recipes_say_what_the_issue_asks():
    lora = load_recipe("single-gpu-lora")
    assert lora.lora and lora.gradient_checkpointing and lora.supports.max_processes == 1
    assert lora.mixed_precision == "auto"
    fsdp = load_recipe("fsdp")
    assert fsdp.fsdp.version == 2 and fsdp.fsdp.reshard_after_forward and fsdp.fsdp.activation_checkpointing
    assert fsdp.fsdp.transformer_layer_cls_to_wrap is None  # taken from the model at run time
    assert fsdp.lora is None and fsdp.fsdp.state_dict_type == "FULL_STATE_DICT"
    z3 = load_recipe("zero3-offload").deepspeed
    assert (z3.zero_stage, z3.offload_optimizer, z3.offload_param, z3.pin_memory) == (3, "cpu", "cpu", True)
    assert z3.zero3_save_16bit_model and load_recipe("zero3-offload").supports.min_processes == 1
    bnb = load_recipe("adamw-8bit")
    assert bnb.optim == "paged_adamw_8bit" and bnb.gradient_checkpointing and bnb.distributed_type == "ddp"


def test_every_memory_knob_carries_a_tradeoff_comment():
    knobs = ("max_seq_length", "per_device_train_batch_size", "gradient_accumulation_steps", "mixed_precision",
             "gradient_checkpointing", "optim", "r:", "target_modules", "offload_optimizer", "offload_param",
             "activation_checkpointing", "reshard_after_forward", "pin_memory", "zero_stage", "stage3_",
             "activation_offload", "quantization", "bits", "quant_type", "double_quant", "quant_storage",
             "use_orig_params", "offload_params", "tp_size", "sp_size", "weight_dtype", "bf16_stochastic_round", "rank:")
    assert set(ALL) == set(recipe_names())
    for name in ALL:
        for line in recipe_path(name).read_text().splitlines():
            if line.lstrip().startswith(knobs):
                assert "#" in line, f"{name}: memory knob without a trade-off comment: {line.strip()}"


def test_recipe_is_immutable():
    r = load_recipe("fsdp")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.learning_rate = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.fsdp.version = 1


def test_resolved_recipe_round_trips_through_yaml():
    r = load_recipe("zero3-offload", ["lora.r=4"])
    assert make_recipe(yaml.safe_load(r.to_yaml())) == r


def test_show_and_validate_resolve_a_base(tmp_path, cli):
    (tmp_path / "mine.yaml").write_text("base: single-gpu-lora\ndataset: data.jsonl\nmax_steps: 5\n")
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    shown = cli("show", str(tmp_path / "mine.yaml"))
    assert shown.returncode == 0, shown.stderr
    resolved = yaml.safe_load(shown.stdout)
    assert resolved["name"] == "mine" and resolved["max_steps"] == 5 and resolved["lora"]["r"] == 16
    assert make_recipe(resolved) == load_recipe(str(tmp_path / "mine.yaml"))
    ok = cli("validate", str(tmp_path / "mine.yaml"))
    assert ok.returncode == 0 and "valid recipe (mine, based on single-gpu-lora)" in ok.stdout
    assert resolved["dataset"] == str(tmp_path / "data.jsonl")  # the recipe's relative path, from its own folder
    (tmp_path / "typo.yaml").write_text("base: single-gpu-lora\nlearning_rat: 1e-4\n")
    bad = cli("validate", str(tmp_path / "typo.yaml"))
    assert bad.returncode == 2 and "did you mean 'learning_rate'" in bad.stderr and "Traceback" not in bad.stderr


def test_docs_configs_names_every_recipe_key():
    """docs/configs.md is the key reference: every key of the recipe and of each section is in it."""
    from helpers import REPO
    from memrecipe.planning import recipe as schema

    text = (REPO / "docs" / "configs.md").read_text()
    sections = (schema.Recipe, schema.Supports, schema.DataSource, schema.Columns, schema.Lora, schema.OptimArgs,
                schema.Quantization, schema.Fsdp, schema.DeepSpeed, schema.Parallelism, schema.Dpo)
    missing = [f"{cls.__name__}.{f.name}" for cls in sections for f in dataclasses.fields(cls) if f"`{f.name}`" not in text]
    assert not missing


def test_the_key_tables_in_docs_configs_are_the_fields_help():
    """Each top-level and lora: key's help lives once, in its field's metadata: docs/configs.md's two key tables are
    those rows, in the fields' order (`memrecipe show --keys` prints them)."""
    from helpers import REPO
    from memrecipe.planning.recipe import Lora, Recipe
    from memrecipe.planning.schema import key_rows

    text = (REPO / "docs" / "configs.md").read_text()
    for heading, cls in (("### Top-level keys", Recipe), ("### `lora:`", Lora)):
        table = next(block for block in text[text.index(heading):].split("\n\n") if block.startswith("| key")).splitlines()
        assert table[2:] == [f"| {keys} | {default} | {help} |" for keys, default, help in key_rows(cls)], heading
    assert all(help for cls in (Recipe, Lora) for _, _, help in key_rows(cls))
