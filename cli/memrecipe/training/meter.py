"""The Meter: each optimizer step's record (logged to accelerate's trackers), the setup's facts (facts.py) and the
memory probes (probes.py) run at their moments, gathered at the end into Measured, what the report takes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..planning.optimizers import OPTIMIZERS, bf16_rounding
from ..planning.registry import embedded_settings_said, is_embedded
from .facts import SetupFacts, describe_setup
from .probes import (DeviceSampler, LossMemory, MemorySnapshot, StepProfile, held_bytes, optimizer_state_dtypes,
                     peak_memory)


def window_counts(window: list[dict], targets: int, reduce, tp_size: int = 1) -> tuple[dict, int]:
    """A step's counts over all processes, each batch once: target tokens (`targets`, already summed over
    processes), real (non-padding) tokens and slots (what the batches' shape computed on); and this
    process's real tokens. `reduce` sums a tensor over processes. The ranks of a tensor-parallel group
    share one batch (accelerate shards the data over the other mesh dimensions), so sums over processes
    count each batch tp_size times."""
    local = sum(int(b["attention_mask"].sum()) for b in window)
    slots = sum(b["input_ids"].numel() for b in window)
    real, slots = reduce(torch.tensor([local, slots])).tolist()
    return {"targets": targets // tp_size, "tokens": real // tp_size, "slots": slots // tp_size}, local




def start_trackers(accelerator, recipe, out) -> bool:
    """accelerate's own trackers (tensorboard, wandb) for the run folder, once the folder is known.
    Returns False (with one line saying what to install) when the tracker's package is missing."""
    if recipe.report_to == "none":
        return False
    from accelerate.tracking import filter_trackers

    accelerator.project_configuration.set_directories(str(out))
    accelerator.log_with = filter_trackers([recipe.report_to], accelerator.logging_dir)
    if not accelerator.log_with:
        accelerator.print(f"memrecipe: report_to {recipe.report_to} is not installed (pip install "
                          f"'memrecipe[tracking]' for tensorboard, or wandb): training without it")
        return False
    accelerator.init_trackers("tracking", config=flat_config(recipe.to_dict()))
    return True


def flat_config(tree: dict, prefix: str = "") -> dict:
    """{'lora': {'r': 8}} -> {'lora.r': 8}: trackers take scalars (TensorBoard's hparams)."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flat_config(value, f"{name}.")
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out




@dataclass
class Measured:
    """What a run measured, as its report takes it (report.build)."""

    setup: SetupFacts  # the live objects' facts (describe_setup), with the optimizer's state dtypes and offloaded bytes
    history: list[dict]  # one record per optimizer step: loss, lr, counts, seconds, grad_norm, eval_loss
    processes: list[dict]  # each process's held bytes, tokens and memory peaks
    wall_seconds: float  # this session's training loop (not the final eval and save)
    eval_loss: float | None  # on the whole eval set at the end
    eval_metrics: dict = field(default_factory=dict)  # the objective's other eval figures at the end (eval_rewards/...)


class Meter:
    """What a run measures about itself, in one object: the setup as it really is (describe_setup), each
    optimizer step's record (loss, learning rate, target/real/padded tokens over all processes, seconds; logged
    to TensorBoard / W&B when the recipe's report_to asks), what the model states hold after the first update
    (held_bytes) and the loss's peak (LossMemory), memory over the first steps (--memory-snapshot), one step's time
    by op (--profile), and each process's peaks at the end. `finish` returns them as Measured, for the report."""

    def __init__(self, accelerator, recipe, out, model, optimizer, offload=None, snapshot: bool = False,
                 profile: bool = False):
        self.accelerator, self.model, self.optimizer, self.offload = accelerator, model, optimizer, offload
        self.out, self.take_snapshot = out, snapshot
        self.profile = StepProfile(out, accelerator) if profile else None
        self.setup = describe_setup(accelerator, model, optimizer)
        # this process's peak host RAM up to here: loading and preparing the model, before any step (under FSDP2's
        # cpu_ram_efficient_loading rank 0 alone holds the whole model)
        self.load_peak = peak_memory(torch.device("cpu"))["peak_rss_bytes"]
        self.device_use = DeviceSampler(accelerator.device)  # what the device really holds, sampled (CUDA)
        # the optimizer as the recipe chose it: how updates reach bf16 weights, what its first step costs on a GPU
        self.setup.bf16_update_rounding = bf16_rounding(recipe)
        # memrecipe's tiny model, trained at its own settings (registry.with_embedded_settings), not the recipe's
        self.setup.embedded_model = is_embedded(recipe.model_name_or_path)
        self.setup.embedded_settings = embedded_settings_said(recipe) if self.setup.embedded_model else None
        self.setup.optimizer_first_use = OPTIMIZERS[recipe.optim].first_use_on_cuda \
            if accelerator.device.type == "cuda" else ""
        self.tracking = start_trackers(accelerator, recipe, out)
        self.tp_share = recipe.tensor_parallel * recipe.context_parallel  # a TP group's or ring's ranks see one batch
        self.history, self.held, self.tokens, self.wall = [], None, 0, None
        self.beside = []  # models kept beside the trained one (hold)
        self.snapshot = self.loss_memory = None

    def resumed(self, state: dict) -> None:
        """A resumed run's history goes on from its checkpoint's."""
        self.history = state["history"]
        self.setup.resumed_at_step = state["step"]

    def hold(self, *models) -> None:
        """Models the objective keeps beside the trained one (DPO's frozen reference): their parameters are held."""
        self.beside += models

    def start(self) -> None:
        """Right before the first step: the clock, the loss's measurement and the memory snapshot start."""
        self.started = time.perf_counter()
        self.snapshot = MemorySnapshot(self.out, self.accelerator) if self.take_snapshot else None
        self.loss_memory = LossMemory(self.model, self.accelerator.device)  # on the first micro batch

    def updated(self) -> None:
        """After an optimizer step, before zero_grad: the first time, what this process really holds, once the
        optimizer state exists."""
        if self.held is not None:
            return
        self.held = held_bytes(self.model, self.optimizer, self.beside)
        self.held["logits"] = self.loss_memory.bytes
        self.setup.optimizer_state_dtypes = optimizer_state_dtypes(self.optimizer)
        if self.offload is not None:  # activation offload: what one micro batch's checkpoints kept on the host
            self.setup.offloaded_bytes_per_micro_batch = self.offload.bytes // self.accelerator.gradient_accumulation_steps

    def record(self, step: int, window: list[dict], loss: float, targets: int, lr: float, started: float,
               grad_norm=None, evaluated: dict | None = None, metrics: dict | None = None) -> dict:
        """The step's record, kept in the history and logged to the trackers: with the objective's own metrics
        (e.g. preference tuning's rewards/...) and an eval's ({"eval_loss": ..., "eval_rewards/...": ...})."""
        reduce = lambda t: self.accelerator.reduce(t.to(self.accelerator.device), "sum")  # noqa: E731
        counts, local = window_counts(window, targets, reduce, self.tp_share)  # each batch once
        self.tokens += local
        record = {"step": step, "loss": loss, **counts, "lr": lr, "seconds": time.perf_counter() - started}
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        record.update(metrics or {})
        record.update(evaluated or {})
        self.history.append(record)
        if self.tracking:
            self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=step)
        if self.snapshot is not None and step == self.snapshot.steps:
            self.snapshot.save()
        if self.profile is not None and step == self.setup.resumed_at_step + 1:
            self.profile.begin(step + 1)  # this session's second step (after the snapshot's: one profiler at a time)
        elif self.profile is not None and self.profile.profiler is not None and self.profile.path is None:
            self.accelerator.print(f"profile of step {step}: {self.profile.end()}")
        return record

    def stop(self) -> None:
        """The training loop is over: its clock stops (the final eval and save are not training)."""
        self.wall = time.perf_counter() - self.started

    def finish(self, eval_loss: float | None, evaluated: dict | None = None) -> Measured:
        """Every process's figures, gathered (a collective: every process calls it), after the final save."""
        from accelerate.utils import gather_object

        if self.held is None:  # a resume from the last step's checkpoint trains no step: held as it was loaded
            self.held = held_bytes(self.model, self.optimizer, self.beside) | {"logits": None}
        processes = gather_object([{"process_index": self.accelerator.process_index,
                                    "num_processes": self.accelerator.num_processes, "held": self.held,
                                    "tokens": self.tokens, "load_peak_rss_bytes": self.load_peak,
                                    # CUDA: the allocator's peak before the loss's window reset it (loading's own)
                                    "cuda_peak_before_training_bytes": getattr(self.loss_memory, "before_peak", None),
                                    "cuda_device_used_peak_bytes": self.device_use.stop(),
                                    # the activation offload's host block (pinned on CUDA: not in the host allocator's stats)
                                    "offload_host_bytes": self.offload.arena.size if self.offload is not None else None,
                                    **peak_memory(self.accelerator.device)}])
        if self.snapshot is not None and not self.snapshot.saved:
            self.snapshot.save()
        return Measured(self.setup, self.history, processes, self.wall or 0.0, eval_loss,
                        {k: v for k, v in (evaluated or {}).items() if k != "eval_loss"})
