"""Check files with the anchors' own loaders: accelerate's config loader and launch parser,
DeepSpeed's ZeRO config model. Imported only by `memrecipe validate` (they import torch)."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import RecipeError, did_you_mean


def check_accelerate_config(path: Path) -> str:
    """Load with accelerate's own loader; nested keys must be `accelerate launch` options. Returns a summary."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    try:
        cfg = load_config_from_file(str(path))
    except (ValueError, TypeError) as e:
        raise RecipeError(f"{path}: accelerate refuses it: {' '.join(str(e).split())}") from None
    options = {a.dest for a in launch_command_parser()._actions}
    for section, prefix in (("fsdp_config", "fsdp_"), ("deepspeed_config", "")):
        for key in getattr(cfg, section) or {}:
            dest = key if key.startswith(prefix) else prefix + key
            if dest not in options:
                known = sorted(o for o in options if o.startswith(prefix or "zero") or o.startswith("deepspeed"))
                raise RecipeError(f"{path}: unknown key {section}.{key}{did_you_mean(dest, known)}")
    ds_file = (cfg.deepspeed_config or {}).get("deepspeed_config_file")
    if ds_file:
        target = Path(ds_file)
        if not target.is_file() and (path.parent / target.name).is_file():
            target = path.parent / target.name
        if not target.is_file():
            raise RecipeError(f"{path}: deepspeed_config_file {ds_file} does not exist (paths are relative to "
                              "the folder you run accelerate launch from)")
        check_deepspeed_json(target)
    return f"{cfg.distributed_type.value}, {cfg.num_processes} process(es) on {cfg.num_machines} machine(s)"


def check_deepspeed_json(path: Path) -> str:
    """The zero_optimization section through DeepSpeed's own config model; no train_batch_size."""
    from pydantic import ValidationError

    from .hardware import quiet_deepspeed

    quiet_deepspeed()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        cfg = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise RecipeError(f"{path} is not readable JSON: {e}") from None
    if "train_batch_size" in cfg:
        raise RecipeError(f"{path}: train_batch_size assumes a world size; set train_micro_batch_size_per_gpu "
                          "and gradient_accumulation_steps instead")
    try:
        zero = DeepSpeedZeroConfig(**cfg.get("zero_optimization", {}))
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise RecipeError(f"{path}: zero_optimization.{where}: {err['msg']}") from None
    return f"DeepSpeed ZeRO stage {int(zero.stage)}"
