"""Where the recipes and generated configs live, and name -> Recipe resolution."""

from __future__ import annotations

from pathlib import Path

from ..errors import RecipeError, did_you_mean
from .paths import from_recipe_file
from .recipe import Recipe, make_recipe, merge, parse_overrides, read_yaml

PACKAGE = Path(__file__).resolve().parents[1]  # memrecipe/ (cli/ in a checkout)
# the embedded default: a tiny Llama (config and tokenizer; weights built from a seed) and a chat set
EMBEDDED_MODEL = PACKAGE / "data" / "tiny-llama"
EMBEDDED_DATASET = PACKAGE / "data" / "chat.jsonl"


def data_dir(name: str) -> Path:
    """recipes/ or accelerate_configs/: inside the installed package, or beside cli/ in a checkout."""
    for candidate in (PACKAGE / name, PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
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


def resolve(path: Path, chain: tuple[Path, ...] = ()) -> dict:
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
    return merge(resolve(base_path, (*chain, path.resolve())), data)


def load_recipe(name_or_path: str, overrides=()) -> Recipe:
    """The validated Recipe for a name or file (its `base:` chain resolved), with `key=value` override words applied."""
    path = recipe_path(name_or_path)
    try:
        return make_recipe(resolve(path), parse_overrides(overrides))
    except RecipeError as e:
        raise RecipeError(f"recipe {name_or_path}: {e}") from None
