"""Checkpoints a killed run can continue from exactly: written whole or not at all.

A checkpoint is accelerate's `save_state` (model, optimizer and LR scheduler, sharded the way the
engine shards them: FSDP state, DeepSpeed ZeRO checkpoint with offloaded optimizer state; the RNG
states of every process) plus `trainer_state.json` (step, epoch, micro batches consumed in the
epoch, world size, the per-step history). It is written into `checkpoints/.tmp-step-N/` by every
process and renamed to `checkpoints/step-N/` once all of them are done, so a reader never takes a
partial checkpoint for the newest.

Several machines may share the run folder (a shared filesystem) or each have their own: the run
finds out at its start (`folder_sharing`). Shared: one process renames, the global main. Not shared:
each machine writes a whole checkpoint of its own (accelerate's save_on_each_node) and renames it.
"""

from __future__ import annotations

import functools
import json
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path

from ..errors import RecipeError
from ..files import readable_files
from ..layout import CHECKPOINTS, NAME, PROBE, STATE, checkpoint_files, complete_checkpoints


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
      load_state loads them non-strictly (Checkpoints.resume checks that every trainable tensor was there)."""
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

    return accelerator.distributed_type.value == "FSDP" and bool(is_peft_model(accelerator.unwrap_model(model)))


def _keep_trained(models, weights, output_dir):
    for i, model in enumerate(models):
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        weights[i] = {name: tensor for name, tensor in weights[i].items() if name in trained}


class Checkpoints:
    """The run's checkpoints, as every process of it writes and reads them. Made after `prepare`, by
    every process: it asks all machines whether they see one run folder (see `folder_sharing`)."""

    def __init__(self, accelerator, model, out, keep: int | None = None):
        self.accelerator, self.model, self.folder, self.keep = accelerator, model, Path(out) / CHECKPOINTS, keep
        self.machines, self.shared = folder_sharing(accelerator, out)
        if not self.shared:
            kind = accelerator.distributed_type.value
            if kind in ("FSDP", "DEEPSPEED"):  # their checkpoints are one set of shards over all ranks
                raise RecipeError(f"{kind} checkpoints need one run folder all machines share, and machines 1.. do not "
                                  f"see machine 0's {out}: put --output-dir on a shared filesystem")
            accelerator.project_configuration.save_on_each_node = True  # model, optimizer on every machine
        # the one process per folder that clears, labels, renames and prunes it
        self.owner = accelerator.is_main_process if self.shared else accelerator.is_local_main_process

    def save(self, state: dict) -> Path:
        """Every process calls this at the same optimizer step; returns the finished checkpoint."""
        accelerator = self.accelerator
        final, staging = self.folder / f"step-{state['step']}", self.folder / f".tmp-step-{state['step']}"
        if self.owner:
            shutil.rmtree(staging, ignore_errors=True)  # a leftover of a run killed while saving
        accelerator.wait_for_everyone()
        with frozen_base_left_out(accelerator, self.model):
            accelerator.save_state(str(staging))
        accelerator.wait_for_everyone()  # each process writes its own random states: all of them before the list
        if self.owner:  # with the list of what it holds: a file lost later is named before a resume
            (staging / STATE).write_text(json.dumps({**state, "files": checkpoint_files(staging)}))
        accelerator.wait_for_everyone()
        if self.owner:
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
            if self.keep:
                for old in complete_checkpoints(self.folder.parent)[:-self.keep]:
                    shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        return final

    def resume(self, scheduler) -> dict:
        """Load the newest checkpoint that every machine holds whole into the prepared objects, and set the
        optimizer's learning rates from `scheduler` (see `follow_schedule`); returns its trainer state, with
        `saved_lr`: the rate the checkpoint's optimizer held for the next step. (Machines with folders of their
        own may hold different ones: a run killed between their renames.)"""
        from accelerate.utils import gather_object

        accelerator, out = self.accelerator, self.folder.parent
        mine = {int(NAME.match(p.name).group(1)): p for p in complete_checkpoints(out)}
        common = set.intersection(*(set(steps) for steps in gather_object([sorted(mine)])))
        if not common:
            raise RecipeError(f"no complete checkpoint in {self.folder}" +
                              (" that every machine holds" if mine else
                               ": nothing to resume (set save_steps to write checkpoints)"))
        newest = mine[max(common)]
        state = json.loads((newest / STATE).read_text())
        if state["num_processes"] != accelerator.num_processes:
            raise RecipeError(f"{newest.name} was written by {state['num_processes']} processes, this run has "
                              f"{accelerator.num_processes}: resume with --num-processes {state['num_processes']} "
                              "(resharding a checkpoint is not supported)")
        with frozen_base_left_out(accelerator, self.model) as load_kwargs:
            accelerator.load_state(str(newest), **load_kwargs)
        saved = newest / "model.safetensors"
        if load_kwargs and saved.is_file():  # loaded non-strictly: every trainable tensor must have been there
            from safetensors import safe_open

            with safe_open(str(saved), framework="pt") as f:  # (saved unwrapped: no DDP "module." in the names)
                trained = accelerator.unwrap_model(self.model).named_parameters()
                missing = {n for n, p in trained if p.requires_grad} - set(f.keys())
            if missing:
                raise RecipeError(f"{newest.name} lacks {len(missing)} trained tensor(s) of this model, e.g. "
                                  f"{sorted(missing)[0]}: it was written by another recipe or LoRA setting")
        saved_lr = scheduler.optimizer.param_groups[0]["lr"]
        follow_schedule(scheduler)
        return state | {"path": str(newest), "saved_lr": saved_lr}


def follow_schedule(scheduler) -> None:
    """Set every parameter group's learning rate to the schedule's at its current step. load_state restores the
    optimizer's param groups, and with them the rate the saved run's schedule gave its next step: for a run
    resumed with another max_steps (its schedule rebuilt for the new length; the scheduler's lambdas are the new
    run's, its step count the checkpoint's) that rate is wrong, 0 at the end of an old cosine. The groups are
    reached through the prepared optimizer, so this sets the ones that step: DeepSpeed's engine (its ZeRO
    optimizer's param_groups are its inner optimizer's), and each per-parameter optimizer of StepInBackward."""
    rates = [base * rate(scheduler.last_epoch) for base, rate in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, rates, strict=True):
        group["lr"] = lr
    scheduler._last_lr = rates  # what get_last_lr() reports until the next step


def folder_sharing(accelerator, out) -> tuple[int, bool]:
    """How many machines run, and whether all their processes see one run folder: each machine's first process
    writes a probe file named for its machine into its folder, and every process says which machines' probes it
    sees. True on one machine; on several, True when all share one folder (a shared filesystem), False when each
    has its own. Any other grouping (machines 1 and 2 sharing a folder that machine 0 does not see, say) is
    refused: two owners would rename and prune the same checkpoints."""
    if accelerator.num_processes == 1:
        return 1, True
    from accelerate.utils import broadcast_object_list, gather_object

    token = [secrets.token_hex(4)]
    broadcast_object_list(token)  # one name for this run's probes
    machine = accelerator.process_index - accelerator.local_process_index  # the machine's first rank
    folder = Path(out)
    mine = folder / f"{PROBE}{token[0]}-{machine}"
    if accelerator.is_local_main_process:
        folder.mkdir(parents=True, exist_ok=True)
        mine.touch()
    accelerator.wait_for_everyone()
    seen = frozenset(int(p.name.rsplit("-", 1)[1]) for p in folder.glob(f"{PROBE}{token[0]}-*"))
    everyone = gather_object([(machine, seen)])
    accelerator.wait_for_everyone()
    if accelerator.is_local_main_process:
        mine.unlink()
    return sharing_verdict(everyone, out)


def sharing_verdict(seen: list[tuple[int, frozenset[int]]], out) -> tuple[int, bool]:
    """(machines, shared) from each process's (its machine's first rank, the machines whose probes it sees)."""
    machines = {m for m, _ in seen}
    if all(sees == machines for _, sees in seen):
        return len(machines), True
    if all(sees == {m} for m, sees in seen):
        return len(machines), False
    groups = sorted({tuple(sorted(sees)) for _, sees in seen})
    raise RecipeError(f"the machines see {len(groups)} different run folders {out} ("
                      + "; ".join(f"first ranks {list(g)} share one" if len(g) > 1 else f"{''.join(map(str, g))} has its own"
                                  for g in groups)
                      + "): give all machines one shared folder, or each its own")


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
        if accelerator.is_main_process:
            readable_files(final)
        return
    state_dict = trained_state_dict(accelerator, model)  # under FSDP with LoRA: the adapters only
    # the adapter that trained, not a frozen reference copy beside it (adapters.add_lora)
    adapter = {"selected_adapters": ["default"]} if hasattr(unwrapped, "peft_config") else {}
    unwrapped.save_pretrained(final, state_dict=state_dict, safe_serialization=True,
                              is_main_process=accelerator.is_main_process, **adapter)
    if accelerator.is_main_process:
        readable_files(final)
