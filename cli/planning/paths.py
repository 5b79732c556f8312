"""Path rules: which recipe keys may name local files, and making those paths absolute (a run starts
inside its own folder, and the slurm script from its own)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..errors import RecipeError
from .recipe import Recipe

PATH_KEYS = ("model_name_or_path", "dataset", "eval_dataset", "chat_template")  # keys that may name local files


def read_adapter(model: str | None) -> dict | None:
    """adapter_config.json of a saved LoRA adapter's folder (an SFT run's final/: no config.json beside it), None for
    anything else (a model folder, a hub id, the embedded default)."""
    path = Path(model).expanduser() if model else None
    if path is None or not (path / "adapter_config.json").is_file() or (path / "config.json").is_file():
        return None
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(f"{path}/adapter_config.json is not valid JSON ({e.msg} at line {e.lineno})") from None
    return config if isinstance(config, dict) else {}


def absolute_path(value):
    """A local path made absolute; hub ids, inline templates, None: the same; each entry of a dataset
    list: its path made absolute."""
    if isinstance(value, tuple):
        return tuple(replace(entry, path=absolute_path(entry.path)) for entry in value)
    if value and "{" not in value and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    return value


def absolute_paths(recipe: Recipe) -> Recipe:
    """The recipe with its local model/dataset/template paths made absolute."""
    return replace(recipe, **{key: absolute_path(getattr(recipe, key)) for key in PATH_KEYS})


# the local dataset files data.load_any reads: suffix -> the datasets builder that reads it
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def looks_local(key: str, value) -> bool:
    """Whether a recipe value can only be a local path (not a hub id, not an inline template)."""
    if not isinstance(value, str) or not value or "{" in value:
        return False
    if value.startswith((".", "/", "~")):
        return True
    return Path(value).suffix in (tuple(FILE_BUILDERS) if key in ("dataset", "eval_dataset") else
                                  (".jinja", ".j2") if key == "chat_template" else ())


def from_recipe_file(data: dict, folder: Path) -> dict:
    """A recipe file's own keys with its relative local paths read against the file's folder, as `base:` is: a
    value that exists there, or can only be a local path (`alpaca.jsonl`, `./data`); hub ids stay as they are."""
    def against(key, value):
        if not isinstance(value, str) or Path(value).expanduser().is_absolute() or "{" in value:
            return value
        there = folder / value
        return str(there) if there.exists() or looks_local(key, value) else value

    out = dict(data)
    for key in PATH_KEYS:
        value = out.get(key)
        if isinstance(value, list):
            out[key] = [{**e, "path": against(key, e["path"])} if isinstance(e, dict) and "path" in e else e
                        for e in value]
        elif value is not None:
            out[key] = against(key, value)
    return out


def check_paths(recipe: Recipe) -> None:
    """A local path that does not exist, refused in one line (before launch, in validate and in a dry run)."""
    for key in PATH_KEYS:
        value = getattr(recipe, key)
        for i, path in enumerate(e.path for e in value) if isinstance(value, tuple) else [(None, value)]:
            if looks_local(key, path) and not Path(path).expanduser().exists():
                where = f"{key}[{i}].path" if i is not None else key
                raise RecipeError(f"{where}: {path} does not exist (a recipe file's relative paths are read from "
                                  "its own folder; a key=value word's from the current one)")


def absolute_word(word: str) -> str:
    """An override `key=value` whose value, for a path key, is made absolute."""
    key, _, value = word.partition("=")
    return f"{key}={absolute_path(value)}" if key in PATH_KEYS else word
