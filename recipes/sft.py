"""Supervised fine-tuning with any memrecipe recipe: one loop for 1 GPU, DDP, FSDP and DeepSpeed.

    memrecipe run sft --recipe single-gpu-lora
    accelerate launch --config_file accelerate_configs/single_gpu_lora_cpu1.yaml \
        recipes/sft.py --recipe recipes/single-gpu-lora.yaml [--output-dir DIR] [key=value ...]

Setup, in order: run (Accelerator, run folder) -> model (its memory techniques, LoRA, compile) -> data ->
optimizer -> prepare -> schedule and checkpoints; then `train` (the loop over windows of micro batches:
log, eval, checkpoint) and `finish` (the final save and the report). Copy this file to change a step:
each is one call in its setup_* function. Everything it takes from memrecipe comes through
`memrecipe.loop` (its docstring lists the names); keys of your own go in the recipe's `extra:`.

Gradient accumulation is exact: an optimizer step sees a window of `gradient_accumulation_steps`
micro batches on every process, and its loss is the sum over all the window's target tokens
divided by their number, counted over all processes. Micro batch x accumulation x processes
therefore trains like one big batch, however unevenly the tokens fall. Under Ulysses sequence
parallelism each process holds a slice of every sequence (its own targets, each counted once), and
micro batch x accumulation x (processes / sp) sequences make a step.
"""

import argparse
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# first: importing memrecipe quiets library notices that say nothing about the run
from memrecipe.loop import (Checkpoints, Collator, Meter, Recipe, RecipeError, RunFolder, add_lora,  # isort: skip
                            apply_rungs, compile_layers, count_targets, embedded_model, flag_overrides, fuse_head,
                            keep_initial_adapter, lm_loss, load_pretrained, load_recipe, load_tokenizer,
                            make_accelerator, make_optimizer, open_run, prepare, prepare_datasets, save_final, Ring,
                            skip_batches, tensor_parallel, wrap_first, write_report)
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase, get_scheduler


@dataclass
class Run:
    """One run's parts, built by main's setup steps in order; `train` and `finish` take it whole."""
    args: argparse.Namespace
    recipe: Recipe
    accelerator: Accelerator
    folder: RunFolder  # the run folder (open_run): path, final, initial_adapter, resume_hint()
    say: Callable[..., None]
    tokenizer: PreTrainedTokenizerBase
    model_path: str  # a hub id, a local folder, or the embedded tiny model's
    model: torch.nn.Module  # prepared: DDP / FSDP / DeepSpeed's engine
    initial_adapter: Path | None  # PiSSA/OLoRA's adapter as initialized, to convert the final one back
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    train_loader: DataLoader
    eval_loader: DataLoader | None
    total_steps: int
    checkpoints: Checkpoints
    meter: Meter
    objective: "Objective"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", required=True, help="a recipe name or YAML file")
    parser.add_argument("--model", default=None, help="hub id or local folder (the recipe's model_name_or_path)")
    parser.add_argument("--dataset", default=None, help="hub id or .jsonl/.json/.parquet/.csv file (the recipe's dataset)")
    parser.add_argument("--output-dir", default=None, help="run folder (default: runs/<recipe>-<time>)")
    parser.add_argument("--overwrite", action="store_true", help="train into a folder that holds a finished run")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--memory-snapshot", action="store_true",
                        help="record memory over the first steps (CUDA allocator history, or CPU profiler timeline)")
    parser.add_argument("--profile", action="store_true",
                        help="record where the second step's time goes (torch's profiler: profile_rank*.txt, .json)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. max_steps=10")
    args = parser.parse_intermixed_args(argv)  # key=value words before, between or after the options
    # the same words as `memrecipe run`: --model and --dataset are overrides of the recipe's keys
    args.overrides += flag_overrides(model=args.model, dataset=args.dataset)
    return args


def windows(dataloader, size):
    """Yield lists of `size` micro batches (an epoch holds whole windows only: see `train_loader`)."""
    window = []
    for batch in dataloader:
        window.append(batch)
        if len(window) == size:
            yield window
            window = []


def accumulate_window(model, window, accelerator):
    """Forward and backward over one window of micro batches, leaving the step's gradient in .grad.

    The loss's denominator is the number of target tokens in the whole window, over all
    processes. Gradients are averaged over processes (under Ulysses too: ZeRO-3's reduce-scatter
    averages over all of them, a sequence's slices included) and accelerate divides each micro
    batch's loss by the accumulation steps; scaling by both makes the gradient sum(token losses) /
    targets, exactly the gradient of one big batch. Under ring attention a ring's processes share each batch, each
    computing its slice's loss: the ring's targets count once. Returns (mean loss per target token, the targets
    summed over processes: a tensor-parallel group's or a ring's batch counted by each of its processes).
    """
    ring = Ring(accelerator)  # (size 1: no ring attention)
    local = sum(count_targets(batch, per_sequence=True).sum() for batch in window)  # on the device
    counted = accelerator.reduce(local, "sum").item()  # (read once a step, not once a micro batch)
    targets = counted // ring.size
    scale = accelerator.num_processes * accelerator.gradient_accumulation_steps / targets
    loss_sum = torch.zeros((), device=accelerator.device)
    for batch in window:
        # no gradient sync until the window's last micro batch; under ring attention, this process's slice
        with accelerator.accumulate(model), ring.shards(batch) as batch:
            loss = lm_loss(model, batch)  # summed over the micro batch's target tokens
            accelerator.backward(loss * scale)  # under DeepSpeed the engine also steps here, on the last batch
            loss_sum += loss.detach()
    return accelerator.reduce(loss_sum, "sum").item() / targets, counted


class Objective:
    """What `train` and `finish` ask of the objective: a window's forward and backward ({"loss", "targets", and any
    metrics to record}), and an eval ({"eval_loss", ...}). SFT's is the next-token cross-entropy per target token;
    recipes/dpo.py brings preference tuning's to the same loop."""

    def __init__(self, recipe):
        self.recipe = recipe
        self.held = []  # models it keeps beside the trained one (DPO's frozen reference): counted as the run's

    def describe(self) -> str | None:
        """A start-up line about the objective (None: nothing to say)."""
        return None

    def start(self, model, train_loader, eval_loader, accelerator, run, say) -> None:
        """Before the first step (and before a resume loads its checkpoint): nothing, for SFT."""

    def window(self, model, window, accelerator) -> dict:
        loss, targets = accumulate_window(model, window, accelerator)
        return {"loss": loss, "targets": targets}

    def evaluate(self, model, dataloader, accelerator) -> dict:
        return {"eval_loss": evaluate(model, dataloader, accelerator)}


class StopRequest:
    """SIGTERM (preemption) or SIGINT (Ctrl-C) asks the run to stop: it finishes the step, all
    processes agree on it, and a checkpoint is written. A second Ctrl-C stops at once; repeated
    SIGTERMs (the launcher's and torchrun's) are one request."""

    def __init__(self):
        self.signum = 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._request)

    def _request(self, signum, frame):
        self.signum = self.signum or signum
        if signum == signal.SIGINT:
            signal.signal(signum, signal.default_int_handler)

    @property
    def name(self):
        return signal.Signals(self.signum).name

    def agreed(self, accelerator) -> bool:
        flag = torch.tensor(self.signum, device=accelerator.device)
        self.signum = int(accelerator.reduce(flag, "max"))  # no rank waits in a collective the others left
        return self.signum != 0


@torch.no_grad()
def evaluate(model, dataloader, accelerator):
    """Mean loss per target token over the eval set, over all processes (each sequence once:
    gather_for_metrics drops the copies that even out the last batch across processes)."""
    model.eval()
    loss_sum, targets = 0.0, 0
    for batch in dataloader:
        per_sequence = lm_loss(model, batch, per_sequence=True)
        counts = count_targets(batch, per_sequence=True)
        per_sequence, counts = accelerator.gather_for_metrics((per_sequence, counts))
        loss_sum, targets = loss_sum + per_sequence.sum().item(), targets + counts.sum().item()
    model.train()
    return loss_sum / targets


def setup_run(args, recipe):
    """The Accelerator (the launch config, accelerate YAML / DeepSpeed JSON, says how processes share the
    work), the run folder, and `say` (prints on the main process only)."""
    accelerator = make_accelerator(recipe)
    run = open_run(accelerator, recipe, args.output_dir, args.overwrite, args.resume)  # runs/<recipe>-<time>
    set_seed(recipe.seed)
    say = tqdm.write if accelerator.is_main_process else (lambda *a, **k: None)
    if recipe.mixed_precision not in ("auto", accelerator.mixed_precision):
        say(f"note: the recipe asks for mixed_precision {recipe.mixed_precision}, the launch config runs "
            f"{accelerator.mixed_precision}; the config wins (regenerate it with memrecipe config, or use memrecipe run)")
    return accelerator, run, say


def setup_model(recipe, model_path, accelerator, run, say):
    """The model (a hub id, a local folder, or the embedded tiny default) with the recipe's memory techniques,
    then its LoRA adapters and compiled layers. Returns (model, activation offload hooks or None, the PiSSA/OLoRA
    initial adapter's folder or None)."""
    # the weights in the recipe's dtype; 4/8-bit quantization (bitsandbytes) as they load
    model = load_pretrained(recipe, model_path, accelerator.mixed_precision, accelerator.device)
    if recipe.rope_scaling:  # RoPE stretched past the model's own positions, in its config (saved with the model)
        rope = model.config.get_text_config().rope_parameters
        say(f"rope_scaling: {rope['rope_type']} x{rope['factor']:g} from {rope['original_max_position_embeddings']:,} "
            f"positions, to {model.config.get_text_config().max_position_embeddings:,}")
    if recipe.tensor_parallel > 1:  # tensor parallel: each linear split over the mesh's "tp" dimension
        tensor_parallel(model, recipe.tensor_parallel, accelerator.torch_device_mesh)
    # the activation ladder's rungs the recipe stands on (planning/rungs.py), each its module's apply: here
    # checkpointing (each layer recomputed in backward) and its offload (the saved inputs in host memory)
    offload = apply_rungs(model, recipe, accelerator, after_adapters=False).get("layers")
    if recipe.lora:  # peft, configured by the recipe's lora: section, or a saved adapter trained on (lora.adapter)
        # (under DPO, a saved adapter is also kept frozen beside it: the reference, as TRL's ref_adapter_name)
        model = add_lora(model, recipe.lora, reference=recipe.dpo is not None and not recipe.dpo.reference_free,
                         accelerator=accelerator,  # (autocast, or DeepSpeed's 16-bit engine: adapters in its dtype)
                         compiled=recipe.torch_compile, redraw=not recipe.keeps_dropout)
        if recipe.lora.adapter:
            say(f"lora: trains on the saved adapter {recipe.lora.adapter} (r {recipe.lora.r})")
    # ... and those that wrap the adapted layers: the tiled MLP (each MLP a tile of tokens at a time, recomputed in
    # backward) and lean norms (each RMSNorm keeps its input, its backward a tile of tokens at a time)
    apply_rungs(model, recipe, accelerator, after_adapters=True)
    if recipe.torch_compile:
        compile_layers(model)  # each decoder layer in place: names, hooks and checkpoints unchanged
    # PiSSA/OLoRA rewrite the base: the adapter as initialized is kept, to convert the final one back
    initial_adapter = keep_initial_adapter(model, recipe, run.initial_adapter, accelerator.is_main_process)
    if recipe.fused_loss:  # the head and the loss run chunk by chunk: the [tokens x vocab] logits are never held
        not_fused = fuse_head(model, recipe.loss_chunk_tokens)
        if not_fused:
            say(f"note: fused_loss is off for this model ({not_fused}): the loss uses the full logits")
    # in the mode it trains in before anything reads it: a train() that resets a module (transformers 5.25's
    # re-kernelizing undid lean norms) then shows in the start-up lines and report.json, not only in the bytes
    model.train()
    return model, offload, initial_adapter


def setup_data(recipe, tokenizer, accelerator, say):
    """Train and eval loaders: tokenized once (main process first, the others read its cache), whole
    documents packed into rows (packing: true, each with its own position_ids) or one example per row,
    padded per batch."""
    with accelerator.main_process_first():
        train_set, eval_set = prepare_datasets(recipe, tokenizer, say)  # logs what the loss will learn from
    # compiled: few shapes; under Ulysses: rows of a multiple of sp tokens, each with its position_ids
    collate = Collator(tokenizer.pad_token_id, 64 if recipe.torch_compile else 1, sequence_parallel=Ring(accelerator).row_multiple)
    eval_loader = DataLoader(eval_set, batch_size=recipe.per_device_train_batch_size, collate_fn=collate) \
        if eval_set is not None else None
    return train_loader(recipe, train_set, collate), eval_loader


def train_loader(recipe, train_set, collate):
    """Micro batches of a new seeded shuffle each epoch (accelerate's seedable sampler: the order is a function
    of the seed and the epoch alone), whole global batches only. Sharded by accelerate, process i takes micro
    batches i, i + N, ...: with drop_last every optimizer step trains the same rows of the shuffle (rows k x G to
    (k + 1) x G; G = micro batch x accumulation x processes) however G is split, and the epoch's last partial
    global batch is left out (a new draw each epoch) instead of topped up with repeats on some topologies."""
    # Its own generator: starting an epoch's iterator must not draw from the global RNG that dropout
    # uses, or a resumed run would see other dropout masks than the run it continues.
    return DataLoader(train_set, batch_size=recipe.per_device_train_batch_size, shuffle=True, drop_last=True,
                      collate_fn=collate, generator=torch.Generator().manual_seed(recipe.seed),
                      pin_memory=torch.cuda.is_available())  # page-locked: the copy to the GPU overlaps compute


def setup_optimizer(recipe, accelerator, model):
    """The recipe's optimizer over the trainable parameters. FSDP1 flattens parameters, so there the model is
    wrapped first (`wrap_first`) and the optimizer built on the wrapped model."""
    model = wrap_first(accelerator, recipe, model)
    # `optim` names an entry of memrecipe's optimizer table (AdamW, 8-bit, paged, torchao, APOLLO), built over
    # groups: weight decay on matrices only, 32-bit state for embeddings under 8-bit optimizers; DeepSpeed's
    # optimizer offload runs its CPU Adam; optimizer_in_backward steps each parameter during backward
    optimizer = make_optimizer(recipe, model, accelerator)
    return model, optimizer


def setup_schedule(recipe, optimizer, train_loader, accelerator):
    """The learning-rate schedule over the run's optimizer steps: (scheduler, total steps, steps per epoch)."""
    accumulation = accelerator.gradient_accumulation_steps  # DeepSpeed's JSON has the last word
    steps_per_epoch = len(train_loader) // accumulation
    if steps_per_epoch == 0:
        rows = f" or max_seq_length ({recipe.max_seq_length}: packed, it makes few long rows)" if recipe.packing else ""
        raise RecipeError(f"the dataset gives {len(train_loader)} micro batch(es) per process, fewer than "
                          f"gradient_accumulation_steps={accumulation}: lower it, per_device_train_batch_size "
                          f"({recipe.per_device_train_batch_size}){rows}")
    total_steps = recipe.max_steps or math.ceil(recipe.num_train_epochs * steps_per_epoch)
    warmup = recipe.warmup_steps or math.ceil(recipe.warmup_ratio * total_steps)
    # Stepped once per optimizer step, by the loop (not prepared: accelerate would step it per process).
    scheduler = get_scheduler(recipe.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                              num_training_steps=total_steps)
    accelerator.register_for_checkpointing(scheduler)
    return scheduler, total_steps, steps_per_epoch


def main(argv=None, script="sft", setup_data=setup_data, objective=Objective):
    """SFT; recipes/dpo.py runs the same steps with its own data and objective (`script` names the loop)."""
    args = parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides, script=script)  # (sft refuses a dpo: section)
    # (the embedded default model is built first: under ZeRO-3 the Accelerator makes every model a collective)
    model_path = recipe.model_name_or_path or embedded_model()
    accelerator, folder, say = setup_run(args, recipe)
    tokenizer = load_tokenizer(model_path, recipe.trust_remote_code, recipe.chat_template)  # + the chat template
    model, offload, initial_adapter = setup_model(recipe, model_path, accelerator, folder, say)
    train_loader, eval_loader = setup_data(recipe, tokenizer, accelerator, say)
    model, optimizer = setup_optimizer(recipe, accelerator, model)
    # wraps the model (DDP / FSDP / DeepSpeed engine) and the optimizer, shards the data
    model, optimizer, train_loader, eval_loader = prepare(accelerator, recipe, model, optimizer, train_loader,
                                                          eval_loader)
    scheduler, total_steps, steps_per_epoch = setup_schedule(recipe, optimizer, train_loader, accelerator)
    # one folder of checkpoints, or one per machine
    checkpoints = Checkpoints(accelerator, model, folder.path, recipe.save_total_limit)
    meter = Meter(accelerator, recipe, folder.path, model, optimizer, offload, args.memory_snapshot, args.profile)
    run = Run(args, recipe, accelerator, folder, say, tokenizer, model_path, model, initial_adapter, optimizer,
              scheduler, train_loader, eval_loader, total_steps, checkpoints, meter, objective(recipe))
    say_setup(run, steps_per_epoch)
    if described := run.objective.describe():
        say(described)
    run.objective.start(model, train_loader, eval_loader, accelerator, folder, say)
    meter.hold(*run.objective.held)  # their parameters count as held, beside the model's
    train(run)
    finish(run)


def say_setup(run, steps_per_epoch):
    """The start-up lines: what runs where, the batch arithmetic, what the data leaves out."""
    recipe, accelerator, setup, say = run.recipe, run.accelerator, run.meter.setup, run.say
    world, accumulation = accelerator.num_processes, accelerator.gradient_accumulation_steps
    sp, ring = setup.sequence_parallel, setup.context_parallel
    data_parallel = world // (recipe.tensor_parallel * sp * ring)  # a TP group or ring shares a batch, an SP group a sequence
    say(f"memrecipe {'dpo' if recipe.dpo else 'sft'}: recipe {recipe.name} | {world} process(es), {setup.engine} on "
        f"{accelerator.device.type} | {accelerator.mixed_precision}"
        + (" (matmuls as fp32 GEMMs rounded to bf16: this CPU has no bf16 GEMM)" if setup.bf16_matmuls_in_fp32 else "")
        + f" | {setup.trainable_params:,} of "
        f"{setup.params:,} parameters train")
    if setup.embedded_model:
        say(f"model: memrecipe's embedded tiny Llama (random weights), {setup.embedded_settings}")
    say(f"batch: {recipe.per_device_train_batch_size} sequences x {accumulation} accumulation x {data_parallel} "
        f"data-parallel process(es) per step | {run.total_steps} steps ({steps_per_epoch} per epoch)")
    if sp > 1:
        say(f"sequence parallel: Ulysses over groups of {sp} processes (DeepSpeed): each holds 1/{sp} of every "
            f"sequence, and its attention whole sequences for 1/{sp} of the heads")
    if ring > 1:
        say(f"ring attention over groups of {ring} processes (torch's context_parallel, FSDP2): each holds 1/{ring} of "
            "every sequence, keys and values passing around the ring")
    rows = len(run.train_loader.dataset)
    per_step = recipe.per_device_train_batch_size * accumulation * data_parallel
    if rows > steps_per_epoch * per_step:  # drop_last (train_loader): whole global batches only
        say(f"data: each epoch trains {steps_per_epoch * per_step:,} of its {rows:,} rows ({steps_per_epoch} steps of "
            f"{per_step}); the other {rows - steps_per_epoch * per_step:,}, a new draw each epoch, are left out")
    if run.checkpoints.machines > 1:
        say(f"{run.checkpoints.machines} machines " + ("share the run folder: machine 0 writes the checkpoints" if
            run.checkpoints.shared else "each keep their own run folder and write whole checkpoints into it"))
    say(f"attention: {setup.attention}" + (f" ({setup.attention_why})" if setup.attention_why else ""))
    say(f"activations: {setup.activations(recipe)}")  # each rung the recipe stands on (planning/rungs.py)
    if setup.bf16_update_rounding:  # the optimizer's choice, said: never a silent fallback
        say(f"weights: bf16, no fp32 master; optim {recipe.optim} rounds each update {setup.bf16_update_rounding}")
    if setup.optimizer_first_use:
        say(f"optim {recipe.optim}: {setup.optimizer_first_use}" + (
            f" (in {setup.optimizer_compile_seconds:.0f} s)" if setup.optimizer_compile_seconds else ""))
    if recipe.torch_compile:
        say("torch_compile: the decoder layers compile during the first step (tens of seconds; again if a batch "
            "brings a new shape), batches are padded to a multiple of 64 tokens")


def resume(run) -> tuple[int, int, int]:
    """The newest complete checkpoint loaded into the prepared objects (model, optimizer, scheduler, RNG states):
    (step, epoch, micro batches of the epoch already trained). The optimizer trains on at this run's schedule."""
    state = run.checkpoints.resume(run.scheduler)
    run.meter.resumed(state)
    run.say(f"resumed from {state['path']} at step {state['step']} (epoch {state['epoch']}, {state['consumed']} "
            "micro batches in)")
    if state.get("total_steps", run.total_steps) != run.total_steps:  # a run extended (or cut short)
        run.say(f"note: {state['total_steps']} -> {run.total_steps} steps: the {run.recipe.lr_scheduler_type} "
                f"schedule is rebuilt for {run.total_steps} steps: step {state['step'] + 1} trains at "
                f"{run.scheduler.get_last_lr()[0]:.3e} (the {state['total_steps']}-step schedule: "
                f"{state['saved_lr']:.3e})")
    return state["step"], state["epoch"], state["consumed"]


def train(run):
    """The loop: one optimizer step per window of micro batches; log, eval and checkpoint as the recipe says;
    a stop request (SIGTERM, Ctrl-C) checkpoints and exits."""
    recipe, accelerator, model, optimizer, meter = run.recipe, run.accelerator, run.model, run.optimizer, run.meter
    accumulation = accelerator.gradient_accumulation_steps
    deepspeed = accelerator.distributed_type.value == "DEEPSPEED"
    step, epoch, consumed = resume(run) if run.args.resume else (0, 0, 0)
    stop = StopRequest()
    meter.start()
    bar = tqdm(total=run.total_steps, initial=step, desc="train", unit="step", disable=not accelerator.is_main_process)
    model.train()
    while step < run.total_steps:
        if hasattr(run.train_loader, "set_epoch"):
            run.train_loader.set_epoch(epoch)  # a new, seeded shuffle each epoch, the same on every process
        batches = skip_batches(accelerator, run.train_loader, consumed)  # (a resumed epoch: from where it stopped)
        for window in windows(batches, accumulation):
            tick = time.perf_counter()
            result = run.objective.window(model, window, accelerator)
            loss, targets = result.pop("loss"), result.pop("targets")
            consumed += accumulation
            if not math.isfinite(loss):  # stop before the update; the last checkpoint stays the last good one
                raise RecipeError(f"the loss is {loss} at step {step + 1}: stopped without saving (lower "
                                  f"learning_rate, or check the data); the newest checkpoint is still good")
            grad_norm = model.get_global_grad_norm() if deepspeed else None  # (the engine's, taken in its step)
            if recipe.max_grad_norm and not deepspeed:  # DeepSpeed clips by its JSON's gradient_clipping
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
            lr = float(optimizer.param_groups[0]["lr"])  # the rate this step trains with (the scheduler sets the next one)
            optimizer.step()
            run.scheduler.step()
            if step == 0 and recipe.torch_compile:
                run.say(f"torch_compile: the first step took {time.perf_counter() - tick:.1f} s, compiling included")
            meter.updated()  # the first time: what the model states hold, once the optimizer state exists
            optimizer.zero_grad()
            step += 1
            evaluating = run.eval_loader is not None and recipe.eval_steps and step % recipe.eval_steps == 0
            record = meter.record(step, window, loss, targets, lr, tick, grad_norm,
                                  run.objective.evaluate(model, run.eval_loader, accelerator) if evaluating else None,
                                  result)
            log(run, bar, record)
            checkpoint_or_stop(run, stop, {"step": step, "epoch": epoch, "consumed": consumed})
            if step >= run.total_steps:
                break
        else:
            epoch, consumed = epoch + 1, 0
    bar.close()
    meter.stop()


def log(run, bar, record):
    """The progress bar every step; a log line every logging_steps and at the last step."""
    bar.update(1)
    bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.1e}",
                    tok_s=f"{record['tokens'] / record['seconds']:,.0f}")
    step = record["step"]
    if step % run.recipe.logging_steps == 0 or step == run.total_steps:
        run.say(f"step {step}/{run.total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                f"{record['tokens'] / record['seconds']:,.0f} tok/s"
                + (f" | eval loss {record['eval_loss']:.4f}" if "eval_loss" in record else ""))


def checkpoint_or_stop(run, stop, where: dict):
    """A checkpoint every save_steps, at the last step, and when a stop was asked for (every process agrees on it:
    then the run exits after saving, naming the command that resumes it). `where`: step, epoch, consumed."""
    step = where["step"]
    stopping = stop.agreed(run.accelerator)  # every process stops at the same step
    if (run.recipe.save_steps and (step % run.recipe.save_steps == 0 or step == run.total_steps)) or stopping:
        path = run.checkpoints.save({**where, "history": run.meter.history, "total_steps": run.total_steps,
                                     "num_processes": run.accelerator.num_processes,
                                     "recipe": run.recipe.to_dict()})  # (a hand-edited recipe.yaml is named on resume)
        run.say(f"checkpoint {path}")
    if stopping:
        run.say(f"stopped by {stop.name} at step {step}; resume with: {run.folder.resume_hint()}")
        run.accelerator.end_training()
        sys.exit(128 + stop.signum)


def finish(run):
    """The final eval; the save (the full weights gathered from FSDP shards or ZeRO-3 partitions, or the LoRA
    adapter); report.json, loss.png and the card: what was measured next to what was planned."""
    accelerator = run.accelerator
    evaluated = run.objective.evaluate(run.model, run.eval_loader, accelerator) if run.eval_loader is not None else {}
    save_final(accelerator, run.model, run.folder.final, run.initial_adapter)
    measured = run.meter.finish(evaluated.get("eval_loss"), evaluated)
    if accelerator.is_main_process:
        run.tokenizer.save_pretrained(run.folder.final)  # with its chat template
        run.say(write_report(run.folder, run.recipe, accelerator, run.model_path, measured))
    # all ranks tear down together: a gloo rank that destroyed its process group while rank 0 still wrote the
    # report was once aborted at exit ("terminate called without an active exception", SIGABRT)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def entry(main):
    """A loop script's entry point: a RecipeError is one line and exit status 2, no traceback. A finished run exits
    without the interpreter's teardown: everything is written and closed by then (finish: the report, the trackers,
    the process group), and tearing down torch, transformers and bitsandbytes only frees memory, ~2 s per process."""
    try:
        main()
    except RecipeError as e:
        print(f"memrecipe: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    entry(main)
