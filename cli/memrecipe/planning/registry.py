"""Where the recipes, generated configs and the embedded default live, and a name or file -> Recipe: YAML
read, `base:` chains merged, `key=value` overrides applied (rules.make_recipe validates the result)."""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import yaml

from ..errors import RecipeError, did_you_mean
from .paths import from_recipe_file, read_adapter
from .recipe import Recipe
from .rules import for_script, make_recipe
from .saved_adapter import trained_on

PACKAGE = Path(__file__).resolve().parents[1]  # memrecipe/ (cli/memrecipe/ in a checkout)
# the embedded default: a tiny Llama (config and tokenizer; weights built from a seed) and a chat set
EMBEDDED_MODEL = PACKAGE / "data" / "tiny-llama"
EMBEDDED_DATASET = PACKAGE / "data" / "chat.jsonl"
EMBEDDED_PREFERENCES = PACKAGE / "data" / "preferences.jsonl"  # the chat set's answers against wrong ones (run dpo)
# The embedded model's own settings, which replace a recipe's (real-model) numbers when it is the model: its random
# weights learn in seconds only at a learning rate that would wreck a real model (as the LoRA and full fine-tune
# rates differ), and its chat set fits rows of 256 tokens. The DPO rate is SFT's here, dpo.max_length half the row.
EMBEDDED_SETTINGS = {"max_seq_length": 256, "num_train_epochs": 3}
EMBEDDED_LEARNING_RATE = {"lora": 5e-3, "full": 1e-3}
# The shipped recipes' rates for a real model by method (the LoRA recipes' 2e-4, the full fine-tunes' 2e-5): what a
# recipe trains at when words switch its method (lora.r=16 on zero3-ulysses; lora=null on single-gpu-lora) and do not
# name a rate: the rate written for the other method is wrong for this one by 10-20x (method_rate)
METHOD_LEARNING_RATE = {"lora": 2e-4, "full": 2e-5}


def model_cache() -> Path:
    """Where the embedded model is built (loading.embedded_model): a folder per config and torch version."""
    return Path(os.environ.get("MEMRECIPE_CACHE", Path.home() / ".cache" / "memrecipe"))


def is_embedded(model: str | None) -> bool:
    """The model is memrecipe's embedded tiny Llama: null, or its built folder (a saved adapter's base)."""
    if not model:  # (the loop builds the embedded model for an empty name too)
        return True
    folder = Path(model).expanduser().resolve()
    return folder.parent == model_cache().expanduser().resolve() and folder.name.startswith("tiny-llama-")


def data_dir(name: str) -> Path:
    """recipes/ or accelerate_configs/ inside the installed package (in a checkout, links to the top-level folders:
    the paths printed are those folders')."""
    candidate = PACKAGE / name
    if candidate.is_dir():
        return candidate.resolve()
    raise FileNotFoundError(f"memrecipe's {name}/ folder is missing from {PACKAGE}: reinstall memrecipe")


def recipe_names() -> list[str]:
    return sorted(p.stem for p in data_dir("recipes").glob("*.yaml"))


def recipe_path(name_or_path: str) -> Path:
    """A recipe name (`fsdp`) or a path to a recipe YAML -> the file."""
    as_path = Path(name_or_path)
    if as_path.suffix in (".yaml", ".yml") or "/" in name_or_path:
        if not as_path.is_file():
            raise RecipeError(f"recipe file {name_or_path} does not exist")
        return as_path
    path = data_dir("recipes") / f"{name_or_path}.yaml"
    if not path.is_file():
        names = recipe_names()
        raise RecipeError(
            f"unknown recipe {name_or_path!r}{did_you_mean(name_or_path, names)}; known: {', '.join(names)}"
        )
    return path


def read_with_bases(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    """A recipe file's keys with its `base:` chain applied: the base recipe (a shipped name, or a file
    relative to this one) is read first and this file changes only what it names. Sections merge key
    by key (`lora: {r: 8}` keeps the base's other LoRA keys); null replaces a whole section (`lora: null`
    turns LoRA off); `name` defaults to the file's stem."""
    data = from_recipe_file(read_yaml(path), path.parent)  # its relative paths: from its own folder
    if "base" not in data:
        return data
    ref = data.pop("base")
    if not isinstance(ref, str) or not ref:
        raise RecipeError(f"base must be a recipe name or a recipe file, got {ref!r}")
    target = ref
    if ref.endswith((".yaml", ".yml")) or "/" in ref:
        target = str((path.parent / ref).expanduser())  # relative to the file that names it
    try:
        base_path = recipe_path(target)
    except RecipeError as e:
        raise RecipeError(f"base: {e}") from None
    if base_path.resolve() in chain or base_path.resolve() == path.resolve():
        raise RecipeError(f"base {ref} leads back to {path.name}: a recipe cannot be its own base")
    data.setdefault("name", path.stem)
    return merge(read_with_bases(base_path, (*chain, path.resolve())), data)


def load_recipe(name_or_path: str, overrides=(), script: str | None = None, embedded: bool = True) -> Recipe:
    """The validated Recipe for a name or file (its `base:` chain resolved), with `key=value` override words applied;
    with `script`, checked for that loop script (its objective's section, e.g. no dpo: under sft). `embedded`: the
    embedded tiny model's own settings applied where it is the model (a run); false: the recipe's own numbers, as a
    written recipe keeps them (written_recipe)."""
    path = recipe_path(name_or_path)
    try:
        given = parse_overrides(overrides)
        if script == "dpo" and "learning_rate" in given:  # run dpo's rate is dpo.learning_rate: the word means it
            given = merge({"dpo": {"learning_rate": given.pop("learning_rate")}}, given)
        written = read_with_bases(path)
        data = merge(written, given)
        if switched := method_rate(written, given):
            data["learning_rate"] = METHOD_LEARNING_RATE[switched]
        recipe = trained_on(make_recipe(with_embedded_settings(data, given, script) if embedded else data))
        return recipe if script is None else for_script(recipe, script)
    except RecipeError as e:
        raise RecipeError(f"recipe {name_or_path}: {e}") from None


def with_embedded_settings(data: dict, given: dict, script: str | None) -> dict:
    """A recipe's keys as the embedded tiny model trains them: its own settings (EMBEDDED_SETTINGS; under run dpo
    its rate as dpo.learning_rate) in place of the recipe's, but for what the overrides `given` set, and
    embedded_settings false, so that a run folder's resolved recipe keeps what it was resolved to. Any other model
    (a saved adapter's base included): the keys as they are."""
    if data.get("embedded_settings", True) is False or not is_embedded(base_model(data)):
        return data
    own = embedded_own(bool(data.get("lora")))
    changes = {key: value for key, value in own.items() if key not in given}
    if script == "dpo" or data.get("dpo") is not None:
        changes["dpo"] = {"learning_rate": own["learning_rate"]}
    changes["embedded_settings"] = False
    return merge(merge(data, changes), given)  # (the overrides again: they win)


def method_rate(written: dict, given: dict) -> str | None:
    """The method ("lora" | "full") whose rate a recipe takes because the words switched it to that method without
    naming a learning_rate (METHOD_LEARNING_RATE); None when they did not switch it."""
    if "learning_rate" in given or "lora" not in given:
        return None
    was, now = bool(written.get("lora")), bool(merge(written, given).get("lora"))
    return None if was == now else "lora" if now else "full"


def method_rate_note(name_or_path: str, overrides=()) -> str | None:
    """What start-up says when the words switched the recipe's method and so its learning rate (method_rate)."""
    written = read_with_bases(recipe_path(name_or_path))
    switched = method_rate(written, parse_overrides(overrides))
    if switched is None:
        return None
    return (f"learning_rate {METHOD_LEARNING_RATE[switched]:g}: the words make {written.get('name', name_or_path)} "
            f"{'a LoRA run' if switched == 'lora' else 'a full fine-tune'}, and its own {written.get('learning_rate'):g} "
            f"is a {'full fine-tune' if switched == 'lora' else 'LoRA'}'s; the shipped "
            f"{'LoRA' if switched == 'lora' else 'full'} recipes' rate (learning_rate=... sets another)")


def written_recipe(name_or_path: str, overrides=()) -> Recipe:
    """The recipe as a file written for later runs carries it (`memrecipe config --output-dir`): the recipe's own
    numbers, the embedded model's applied at run time only when it is the model (embedded_settings true); where the
    words set one of those keys, embedded_settings false, so that the word is what every model trains at."""
    sets_own = bool(set(parse_overrides(overrides)) & set(embedded_own(False)))
    return load_recipe(name_or_path, [*overrides, *["embedded_settings=false"] * sets_own], embedded=False)


def embedded_own(lora: bool) -> dict:
    """The embedded model's own settings for a LoRA run or a full fine-tune: its learning rate and EMBEDDED_SETTINGS."""
    return {"learning_rate": EMBEDDED_LEARNING_RATE["lora" if lora else "full"], **EMBEDDED_SETTINGS}


def embedded_settings_said(recipe) -> str:
    """The start-up line's account of the numbers the embedded tiny model trains at: its own settings
    (with_embedded_settings), or which of them the recipe or its words changed (key=value, embedded_settings false)."""
    own = embedded_own(recipe.lora is not None)
    values = {key: getattr(recipe, key) for key in own}
    said = f"learning_rate {values['learning_rate']:g}, max_seq_length {values['max_seq_length']}, " \
           f"{values['num_train_epochs']:g} epochs"
    changed = [f"{key} {own[key]:g}" for key in own if values[key] != own[key]]
    if not changed:
        return f"at its own settings: {said} (the recipe's numbers are a real model's: --model gives them)"
    return (f"at {said}: not its own {', '.join(changed)}, which the recipe or its words set "
            "(embedded_settings, docs/configs.md)")


def base_model(data: dict) -> str | None:
    """The model a recipe's keys train: model_name_or_path, or a saved adapter's base (trained_on)."""
    model, lora = data.get("model_name_or_path"), data.get("lora")
    adapter = lora.get("adapter") if isinstance(lora, dict) else None
    if adapter or not isinstance(model, str):
        return model
    config = read_adapter(model)  # the model is a saved adapter's folder: its base
    return config.get("base_model_name_or_path") or model if config else model


FLAG_KEYS = {"model": "model_name_or_path", "dataset": "dataset", "report_to": "report_to"}


def flag_overrides(**flags) -> list[str]:
    """Flags that stand for recipe keys (--model, --dataset; run's --report-to), as override words: the same
    on every command and in the loop's own command line. Unset flags (None) give none."""
    return [f"{FLAG_KEYS[flag]}={value}" for flag, value in flags.items() if value is not None]


def parse_overrides(words) -> dict:
    """['lora.r=8', 'max_steps=null'] -> {'lora': {'r': 8}, 'max_steps': None}; values are YAML."""
    out: dict = {}
    for word in words:
        key, sep, text = word.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise RecipeError(f"override {word!r} is not key=value (e.g. learning_rate=1e-4 or lora.r=8)")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise RecipeError(f"override {word!r}: the value is not valid YAML (quote strings with spaces)") from None
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {word!r} conflicts with an earlier override of {part!r}")
        node[leaf] = value
    return out


def merge(base: dict, changes: dict, path: str = "") -> dict:
    """Deep-merge overrides into a recipe dict; a dotted key into a null section creates it."""
    out = dict(base)
    for key, value in changes.items():
        here = f"{path}.{key}" if path else key
        if isinstance(value, dict) and key in out and out[key] is not None:
            if not isinstance(out[key], dict):
                raise RecipeError(f"{here} is a single value, not a section: use {here}=VALUE")
            out[key] = merge(out[key], value, here)
        else:
            out[key] = value
    return out


def read_yaml(path: Path) -> dict:
    """A YAML file's mapping (a copy, the caller's to change). Each text is parsed once a process: one plan loads
    every shipped recipe, with its `base:` chain, for each recipe it weighs."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise RecipeError(f"cannot read {path}: {e.strerror}") from None
    return copy.deepcopy(parse_yaml(text, str(path)))


@functools.lru_cache(maxsize=128)
def parse_yaml(text: str, path: str) -> dict:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise RecipeError(f"{path} is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path} must hold a mapping of recipe keys, got {type(data).__name__}")
    return data
