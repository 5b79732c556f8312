"""Turn a run's final save or any checkpoint into a standalone Hugging Face model folder.

Checkpoint formats, as accelerate's save_state writes them: `model.safetensors` (1 GPU, DDP),
`pytorch_model_fsdp.bin` (FSDP full state dict), `pytorch_model_fsdp_0/` (FSDP sharded, merged
with accelerate's merge_fsdp_weights), `pytorch_model/` (a DeepSpeed ZeRO checkpoint, gathered to
fp32 with DeepSpeed's zero_to_fp32). LoRA runs give an adapter, or with `merge` a full model.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import RecipeError
from .files import readable_files
from .launching.run_folder import RunFolder
from .layout import CHECKPOINTS, FINAL, NAME, RECIPE, complete_checkpoints

EXPORT_DTYPES = ("bf16", "fp32")


def run_of(path: Path, checkpoint: str | None) -> tuple[Path, str | None]:
    """The run folder and checkpoint that a path names: the run folder itself, or (as a user may point at what
    they see) its final/ or one of its checkpoints/step-N."""
    run = path.parent.parent if NAME.match(path.name) and path.parent.name == CHECKPOINTS else \
        path.parent if path.name == FINAL else None
    if run is None or not (run / RECIPE).is_file():
        return path, checkpoint
    named = path.name if path.name != FINAL else None
    if checkpoint is not None and checkpoint != named:
        raise RecipeError(f"{path} is {'checkpoint ' + named if named else 'the final save'} of run {run}, and "
                          f"--checkpoint says {checkpoint}: give the run folder with --checkpoint, or the one path")
    return run, named


def source_of(run: Path, checkpoint: str | None) -> Path:
    folder = RunFolder(run)
    if checkpoint is None:
        if not folder.final.is_dir():
            raise RecipeError(f"{run} has no final/ (the run did not finish): pick one with --checkpoint "
                              f"({', '.join(p.name for p in complete_checkpoints(run)) or 'none written'})")
        return folder.final
    path = folder.checkpoints / checkpoint
    if path not in complete_checkpoints(run):
        names = ", ".join(p.name for p in complete_checkpoints(run)) or "none"
        raise RecipeError(f"{run} has no complete checkpoint {checkpoint}; it has: {names}")
    return path


def checkpoint_state_dict(path: Path) -> dict:
    import torch

    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(path / "model.safetensors")
    if (path / "pytorch_model_fsdp.bin").is_file():
        return torch.load(path / "pytorch_model_fsdp.bin", map_location="cpu", weights_only=True)
    if (path / "pytorch_model_fsdp_0").is_dir():
        import tempfile

        from accelerate.utils import merge_fsdp_weights

        with tempfile.TemporaryDirectory() as tmp:
            merge_fsdp_weights(str(path / "pytorch_model_fsdp_0"), tmp, safe_serialization=True)
            from safetensors.torch import load_file

            return load_file(Path(tmp) / "model.safetensors")
    if (path / "pytorch_model").is_dir():
        from .training.device import quiet_deepspeed

        quiet_deepspeed()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(path), tag="pytorch_model") or {})
    raise RecipeError(f"{path} holds no model state memrecipe knows (model.safetensors, pytorch_model_fsdp*, "
                      "or a DeepSpeed pytorch_model/ folder)")


def export(run: Path, output: Path, checkpoint: str | None = None, merge: bool = False, dtype: str = "fp32") -> Path:
    from .training.device import quiet_deepspeed

    quiet_deepspeed()  # before transformers and peft look for DeepSpeed
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .planning.registry import load_recipe
    from .training.adapters import add_lora
    from .training.loading import embedded_model, model_config

    run, checkpoint = run_of(run, checkpoint)
    folder = RunFolder(run)
    if not folder.recipe.is_file():
        raise RecipeError(f"{run} is not a memrecipe run folder (no {folder.recipe.name})")
    if output.exists() and any(output.iterdir()):
        raise RecipeError(f"{output} is not empty: pick a new folder")
    recipe = load_recipe(str(folder.recipe))
    source = source_of(run, checkpoint)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    base_path = recipe.model_name_or_path or embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(folder.final if folder.final.is_dir() else base_path)
    if recipe.lora:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32,
                                                    config=model_config(recipe, base_path))  # (rope_scaling)
        if source == folder.final:
            model = PeftModel.from_pretrained(base, source)
        else:
            model = add_lora(base, recipe.lora)  # a PiSSA/OLoRA init decomposes the base again, as training did
            # a checkpoint holds the whole model, or (FSDP) the adapters only: every adapter weight must be there
            loaded = model.load_state_dict(checkpoint_state_dict(source), strict=False)
            trained = {n for n, p in model.named_parameters() if p.requires_grad}  # adapters, modules_to_save, biases
            missing = [k for k in loaded.missing_keys if k in trained]
            if loaded.unexpected_keys or missing:
                raise RecipeError(f"{source} does not match the recipe's LoRA settings: "
                                  f"{(loaded.unexpected_keys or missing)[0]} (and {len(loaded.unexpected_keys) + len(missing) - 1} more)")
        model = model.merge_and_unload() if merge else model
    else:
        if merge:
            raise RecipeError(f"recipe {recipe.name} is a full fine-tune: there is no adapter to --merge")
        if source == folder.final:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32,
                                                         config=model_config(recipe, base_path))
            model.load_state_dict(checkpoint_state_dict(source))
    model = model.to(torch_dtype)  # pyright: ignore[reportArgumentType]  (transformers' stub: to() is generate's)
    model.save_pretrained(str(output), safe_serialization=True)  # pyright: ignore[reportCallIssue]  (the same stub)
    tokenizer.save_pretrained(output)
    readable_files(output)
    (output / "memrecipe_export.json").write_text(json.dumps({"run": str(run.resolve()), "source": source.name,
                                                              "merged": merge, "dtype": dtype}, indent=2))
    return output
