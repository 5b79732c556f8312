"""A saved LoRA adapter (an SFT run's final/) as what a recipe trains: the model given as the adapter's folder, or
lora.adapter, turns into the adapter's base with lora: taking the adapter's shape."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import RecipeError
from .paths import read_adapter
from .recipe import Recipe


def trained_on(recipe: Recipe) -> Recipe:
    """A recipe whose model is a saved LoRA adapter (or that names one as lora.adapter) trains that adapter on, on
    its base (on_adapter); any other recipe is returned as it is."""
    named = recipe.lora.adapter if recipe.lora and recipe.lora.adapter else None
    config = read_adapter(named or recipe.model_name_or_path)
    if config is None:
        if named:
            raise RecipeError(f"lora.adapter {named} is no saved adapter's folder (adapter_config.json, e.g. "
                              "runs/<run>/final)")
        return recipe
    return on_adapter(recipe, str(named or recipe.model_name_or_path), config)


def on_adapter(r: Recipe, path: str, config: dict) -> Recipe:
    """The recipe that trains on a saved LoRA adapter (an SFT run's final/, `config` its adapter_config.json): lora:
    takes the adapter's shape (what its weights are; dropout stays the recipe's), lora.adapter the folder they load
    from, and a model given as the adapter itself becomes the adapter's base. A full fine-tune starts from a model:
    refused, naming the merge that makes one."""
    given_as_model = r.model_name_or_path == path
    if r.lora is None:
        run = Path(path).parent if (Path(path).parent / "report.json").is_file() else None
        merge = f"memrecipe export {run} {run}-merged --merge, then --model {run}-merged" if run else \
            "merge it into its base (peft's merge_and_unload, saved with save_pretrained) and pass that folder"
        raise RecipeError(f"{path} is a LoRA adapter, and this recipe fine-tunes a whole model: {merge} (or train the "
                          "adapter on with a LoRA recipe, e.g. --recipe single-gpu-lora)")
    if config.get("peft_type", "LORA") != "LORA" or not config.get("r"):
        raise RecipeError(f"{path} holds a {config.get('peft_type')} adapter: memrecipe trains LoRA adapters on")
    base = config.get("base_model_name_or_path")
    if given_as_model and not base:
        raise RecipeError(f"{path}/adapter_config.json names no base_model_name_or_path: give the base as --model and "
                          f"the adapter as lora.adapter={path}")
    targets = config.get("target_modules") or ()
    lora = replace(r.lora, r=int(config["r"]), alpha=float(config.get("lora_alpha") or config["r"]),
                   target_modules=targets if isinstance(targets, str) else tuple(sorted(targets)),
                   modules_to_save=tuple(config["modules_to_save"]) if config.get("modules_to_save") else None,
                   use_dora=bool(config.get("use_dora")), use_rslora=bool(config.get("use_rslora")),
                   bias=config.get("bias") or "none", init_lora_weights=True, adapter=str(Path(path).expanduser().resolve()))
    return replace(r, lora=lora, model_name_or_path=base if given_as_model else r.model_name_or_path)
