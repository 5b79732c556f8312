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


def check_paths(recipe: Recipe, weights: bool = True) -> None:
    """A local path that does not exist, or a local model folder without whole weights, refused in one line (before
    launch, in validate and in a dry run; `weights` false: a folder with no weights at all passes, for a dry run of a
    job whose weights are not there yet)."""
    for key in PATH_KEYS:
        value = getattr(recipe, key)
        for i, path in enumerate(e.path for e in value) if isinstance(value, tuple) else [(None, value)]:
            if looks_local(key, path) and not Path(path).expanduser().exists():
                where = f"{key}[{i}].path" if i is not None else key
                adapter = recipe.lora.adapter if key == "model_name_or_path" and recipe.lora else None
                if adapter and (read_adapter(adapter) or {}).get("base_model_name_or_path") == path:
                    raise RecipeError(f"{key}: {path} does not exist; it is the base_model_name_or_path of the "
                                      f"adapter {adapter}/adapter_config.json: give the base as --model and the "
                                      f"adapter as lora.adapter={adapter}")
                raise RecipeError(f"{where}: {path} does not exist (a recipe file's relative paths are read from "
                                  "its own folder; a key=value word's from the current one)")
    model = recipe.model_name_or_path
    if model and Path(model).expanduser().is_dir() and (weights or has_weights(Path(model).expanduser())):
        check_weights(Path(model).expanduser())


def has_weights(folder: Path) -> bool:
    """Whether a model folder holds any weights file or index (whole or not: check_weights says)."""
    return any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")) or any(folder.glob("*.index.json"))


def config_only(model: str | None) -> bool:
    """A local model folder with its config.json and no weights yet (a dry run checks the rest)."""
    folder = Path(model).expanduser() if model else None
    return bool(folder and folder.is_dir() and (folder / "config.json").is_file() and not has_weights(folder))


def has_tokenizer(model: str | None) -> bool:
    """Whether a local model folder holds a tokenizer (a hub id or the embedded model: taken as holding one)."""
    folder = Path(model).expanduser() if model else None
    if not (folder and folder.is_dir()):
        return True
    return any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def check_weights(folder: Path) -> None:
    """A model folder holds whole weights: a weights file, or an index and every shard it lists; each safetensors
    file as long as its own header says (a copy cut short would fail deep inside from_pretrained)."""
    if not (folder / "config.json").is_file():
        return  # not a model folder (the config check names what it is)
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, AttributeError):
                raise RecipeError(f"model folder {folder}: {index} is not a weight index (no weight_map)") from None
            missing = [name for name in shards if not (folder / name).is_file()]
            if missing:
                raise RecipeError(f"model folder {folder}: {missing[0]} (listed in {index}) is missing"
                                  + (f", and {len(missing) - 1} more" if len(missing) > 1 else ""))
            break
        if (folder / single).is_file():
            shards = [single]
            break
    else:
        raise RecipeError(f"model folder {folder} has a config.json but no weights (model.safetensors, its shards "
                          "with model.safetensors.index.json, or pytorch_model.bin): save the model there with "
                          "save_pretrained")
    for name in shards:
        if name.endswith(".safetensors"):
            check_safetensors(folder / name)


def check_safetensors(path: Path) -> None:
    """The file is as long as its header says: 8 bytes of header length, the JSON header, then every tensor's
    bytes up to the largest end offset it lists."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        try:
            header = json.loads(f.read(length)) if 0 < length <= size - 8 else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            header = None
    if not isinstance(header, dict):
        raise RecipeError(f"{path} is not a whole safetensors file (its header is unreadable): copy or save it again")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)),
              default=0)
    if size < 8 + length + end:
        raise RecipeError(f"{path} is cut short ({size:,} of {8 + length + end:,} bytes): copy or save it again")


def absolute_word(word: str) -> str:
    """An override `key=value` whose value, for a path key, is made absolute."""
    key, _, value = word.partition("=")
    return f"{key}={absolute_path(value)}" if key in PATH_KEYS else word
