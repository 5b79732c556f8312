"""Checkpoints a killed run can continue from exactly: written whole or not at all.

A checkpoint is accelerate's `save_state` (model, optimizer and LR scheduler, sharded the way the
engine shards them: FSDP state, DeepSpeed ZeRO checkpoint with offloaded optimizer state; the RNG
states of every process) plus `trainer_state.json` (step, epoch, micro batches consumed in the
epoch, world size, the per-step history). It is written into `checkpoints/.tmp-step-N/` by every
process and renamed to `checkpoints/step-N/` once all of them are done, so a reader never takes a
partial checkpoint for the newest.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from .errors import RecipeError
from .run_folder import CHECKPOINTS

STATE = "trainer_state.json"
NAME = re.compile(r"step-(\d+)$")


def complete_checkpoints(out) -> list[Path]:
    """Complete checkpoints of a run folder, oldest first."""
    folder = Path(out) / CHECKPOINTS
    found = [p for p in folder.glob("step-*") if NAME.match(p.name) and (p / STATE).is_file()] if folder.is_dir() else []
    return sorted(found, key=lambda p: int(NAME.match(p.name).group(1)))


@contextmanager
def frozen_base_left_out(accelerator, model):
    """Within this block accelerate's save_state writes, and load_state reads, only what trains when the
    base is frozen (LoRA, QLoRA): the base is the run's model_name_or_path, and saving it again each
    time costs a model's worth of disk (and, under FSDP, of rank 0's host RAM: ~140 GB for a 70B);
    a 4-bit base's quantization state does not even load back into the PEFT model. Yields the keyword
    arguments load_state needs. DeepSpeed checkpoints are left as the engine writes them.
    - FSDP: accelerate's save_fsdp_model / load_fsdp_model have an `adapter_only` option that save_state
      and load_state do not pass on: here they do.
    - one process or DDP: a save_state pre-hook keeps the trainable entries of the gathered weights, and
      load_state loads them non-strictly (resume_state checks that every trainable tensor was there)."""
    kind = accelerator.distributed_type.value
    if kind == "DEEPSPEED" or all(p.requires_grad for p in model.parameters()):
        yield {}
    elif kind == "FSDP":
        if not _fsdp_adapters(accelerator, model):
            yield {}
            return
        import accelerate.accelerator as engine

        saved = engine.save_fsdp_model, engine.load_fsdp_model
        engine.save_fsdp_model, engine.load_fsdp_model = (functools.partial(f, adapter_only=True) for f in saved)
        try:
            yield {}
        finally:
            engine.save_fsdp_model, engine.load_fsdp_model = saved
    else:
        handle = accelerator.register_save_state_pre_hook(_keep_trained)
        try:
            yield {"strict": False}
        finally:
            handle.remove()


def _fsdp_adapters(accelerator, model) -> bool:
    """FSDP over a PEFT model: accelerate's and torch's adapter-only state dicts apply."""
    from accelerate.utils import is_peft_model

    return accelerator.distributed_type.value == "FSDP" and is_peft_model(accelerator.unwrap_model(model))


def _keep_trained(models, weights, output_dir):
    for i, model in enumerate(models):
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        weights[i] = {name: tensor for name, tensor in weights[i].items() if name in trained}


def save(accelerator, model, out, state: dict, keep: int | None) -> Path:
    """Every process calls this at the same optimizer step; returns the finished checkpoint."""
    folder = Path(out) / CHECKPOINTS
    final = folder / f"step-{state['step']}"
    staging = folder / f".tmp-step-{state['step']}"
    if accelerator.is_local_main_process:
        shutil.rmtree(staging, ignore_errors=True)  # a leftover of a run killed while saving
    accelerator.wait_for_everyone()
    with frozen_base_left_out(accelerator, model):
        accelerator.save_state(str(staging))
    if accelerator.is_main_process:
        (staging / STATE).write_text(json.dumps(state))
    accelerator.wait_for_everyone()
    if accelerator.is_local_main_process and staging.exists():
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        if keep:
            for old in complete_checkpoints(out)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def resume_state(accelerator, model, out) -> dict:
    """Load the newest complete checkpoint into the prepared objects; returns its trainer state."""
    found = complete_checkpoints(out)
    if not found:
        raise RecipeError(f"no complete checkpoint in {Path(out) / 'checkpoints'}: nothing to resume "
                          "(set save_steps to write checkpoints)")
    newest = found[-1]
    state = json.loads((newest / STATE).read_text())
    if state["num_processes"] != accelerator.num_processes:
        raise RecipeError(f"{newest.name} was written by {state['num_processes']} processes, this run has "
                          f"{accelerator.num_processes}: resume with --num-processes {state['num_processes']} "
                          "(resharding a checkpoint is not supported)")
    with frozen_base_left_out(accelerator, model) as load_kwargs:
        accelerator.load_state(str(newest), **load_kwargs)
    saved = newest / "model.safetensors"
    if load_kwargs and saved.is_file():  # loaded non-strictly: every trainable tensor must have been there
        from safetensors import safe_open

        with safe_open(str(saved), framework="pt") as f:
            missing = {n for n, p in model.named_parameters() if p.requires_grad} - set(f.keys())
        if missing:
            raise RecipeError(f"{newest.name} lacks {len(missing)} trained tensor(s) of this model, e.g. "
                              f"{sorted(missing)[0]}: it was written by another recipe or LoRA setting")
    return state | {"path": str(newest)}


def trained_state_dict(accelerator, model) -> dict:
    """The state dict to save the finished model from: what trains, gathered once. Under FSDP with LoRA
    only the adapters are gathered (torch's get_model_state_dict with ignore_frozen_params), not the
    frozen base, which the saved adapter points at anyway."""
    if _fsdp_adapters(accelerator, model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        return get_model_state_dict(model, options=options)
    return accelerator.get_state_dict(model)


def save_final(accelerator, model, final: Path, initial_adapter: Path | None = None) -> None:
    """The finished model (or adapter) in `final`, gathered once. A PiSSA/OLoRA adapter (one process or
    DDP) is converted against its `initial_adapter` so that it applies to the original base."""
    unwrapped = accelerator.unwrap_model(model)
    if initial_adapter is not None:  # peft reads the live adapter and the initial one, not a gathered copy
        import warnings

        with warnings.catch_warnings():  # its advice to convert the adapter: this is the conversion
            warnings.filterwarnings("ignore", message=".*changes the base weights of the model")
            unwrapped.save_pretrained(final, safe_serialization=True, is_main_process=accelerator.is_main_process,
                                      path_initial_model_for_weight_conversion=str(initial_adapter))
        return
    state_dict = trained_state_dict(accelerator, model)  # under FSDP with LoRA: the adapters only
    unwrapped.save_pretrained(final, state_dict=state_dict, safe_serialization=True,
                              is_main_process=accelerator.is_main_process)
