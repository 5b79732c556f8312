"""Path rules: which recipe keys may name local files, and making those paths absolute (a run starts
inside its own folder, and the slurm script from its own)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .recipe import Recipe

PATH_KEYS = ("model_name_or_path", "dataset", "eval_dataset", "chat_template")  # keys that may name local files


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


def absolute_word(word: str) -> str:
    """An override `key=value` whose value, for a path key, is made absolute."""
    key, _, value = word.partition("=")
    return f"{key}={absolute_path(value)}" if key in PATH_KEYS else word
