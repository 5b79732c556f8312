"""Where the recipes and generated configs live, and name -> Recipe resolution."""

from __future__ import annotations

from pathlib import Path

from .errors import RecipeError, did_you_mean
from .recipe import Recipe, make_recipe, parse_overrides, read_yaml

PACKAGE = Path(__file__).resolve().parent


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


def load_recipe(name_or_path: str, overrides=()) -> Recipe:
    """The validated Recipe for a name or file, with `key=value` override words applied."""
    path = recipe_path(name_or_path)
    try:
        return make_recipe(read_yaml(path), parse_overrides(overrides))
    except RecipeError as e:
        raise RecipeError(f"recipe {name_or_path}: {e}") from None
