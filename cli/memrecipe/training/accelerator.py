"""The Accelerator for the launch config, made to work on CPU too, and what it prepares: the model wrapped
(DDP, FSDP, a DeepSpeed engine), the optimizer, the data (FSDP1 wraps the model before the optimizer exists)."""

from __future__ import annotations

import os

import torch

from ..errors import RecipeError
from .cpu_matmul import bf16_matmuls_in_fp32
from .device import ask_cpu_once
from .loading import TORCH_DTYPES
from .ring import check_ring
from .sequence import SequenceShards, check_sequence_parallel


def make_accelerator(recipe, **kwargs):
    """The Accelerator for the config accelerate launched us with, made to work on CPU too.

    On a machine without CUDA two accelerate paths need help (measured, see docs/loop.md):
    - DeepSpeed: accelerate finds no backend and would run every rank as a lone process 0;
      a gloo process group fixes the world size and ranks.
    - FSDP: accelerate turns FSDP on only for GPU-like distributed types; the process state is
      set up for CPU (gloo) and marked MULTI_GPU so the FSDP plugin takes over, with device `cpu`.
    """
    from accelerate import Accelerator, PartialState
    from accelerate.utils import (AutocastKwargs, DataLoaderConfiguration, DistributedType,
                                  GradientAccumulationPlugin, InitProcessGroupKwargs)

    if os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower() != "no":
        raise RecipeError("the launch config asks accelerate to compile the whole model (dynamo_config), which wraps "
                          "it and renames its weights: remove dynamo_config and set torch_compile: true in the recipe")
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    # Autocast over fp32 weights caches each weight's 16-bit copy until the forward ends; under checkpointing that
    # holds every layer's copy at the loss for nothing (a transformer uses each weight once per forward, and a
    # layer's recompute runs under an autocast of its own): 2 bytes x the layers' weights (the first GPU run's
    # adamw-8bit row measured 1.7 GiB at 1B: docs/gpu.md). Without the cache each copy is freed after its matmul.
    handlers = [AutocastKwargs(cache_enabled=False), *kwargs.pop("kwargs_handlers", [])]
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true"
    if deepspeed:
        ask_cpu_once()  # before DeepSpeed builds its CPU Adam
    if not torch.cuda.is_available() and launched:
        if deepspeed:
            handlers.append(InitProcessGroupKwargs(backend="gloo"))
        elif os.environ.get("ACCELERATE_USE_FSDP", "false") == "true":
            state = PartialState(cpu=True)
            state.distributed_type = DistributedType.MULTI_GPU
    # Windows of micro batches are built by the loop, so accelerate must not sync on its own at the
    # end of the dataloader (that would cut the window short).
    plugin = GradientAccumulationPlugin(num_steps=recipe.gradient_accumulation_steps, sync_with_dataloader=False)
    # A seeded sampler: every epoch's shuffle is a function of the recipe's seed and the epoch alone, the same on
    # every process, topology and resume (accelerate's SeedableRandomSampler seeds each epoch with data_seed + epoch).
    data = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=recipe.seed)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin, dataloader_config=data, kwargs_handlers=handlers,
                              **kwargs)
    if accelerator.device.type == "cpu" and accelerator.mixed_precision == "bf16":
        bf16_matmuls_in_fp32()  # (where the CPU has no bf16 GEMM: torch's fallback is ~15x slower)
    if accelerator.mixed_precision == "fp16" and recipe.fp16_blocker:  # the launch config's precision wins
        raise RecipeError(f"the launch config runs mixed_precision fp16, and {recipe.fp16_blocker}: set "
                          "mixed_precision: bf16 in it (or regenerate it with memrecipe config on a GPU with bf16)")
    return accelerator


def _fsdp1(accelerator, recipe) -> bool:
    return accelerator.distributed_type.value == "FSDP" and recipe.fsdp is not None and recipe.fsdp.version == 1


def wrap_first(accelerator, recipe, model):
    """FSDP1 flattens parameters, so its optimizer must be built on the wrapped model: the model is
    wrapped here (with LoRA and flat parameters the adapters get FSDP units of their own, PEFT's wrap
    policy; a 4-bit base computes in its storage dtype), as transformers' Trainer does. Every other
    engine takes the model and the optimizer together in `prepare`: the model is returned as it is."""
    if not _fsdp1(accelerator, recipe):
        return model
    fsdp, plugin = recipe.fsdp, accelerator.state.fsdp_plugin
    if recipe.lora and not fsdp.use_orig_params:
        from peft.utils.other import fsdp_auto_wrap_policy

        plugin.auto_wrap_policy = fsdp_auto_wrap_policy(model)
    storage = recipe.quantization.quant_storage if recipe.quantization else None
    if storage not in (None, "uint8"):
        plugin.set_mixed_precision(TORCH_DTYPES[storage], override=True)
    return accelerator.prepare(model)


def prepare(accelerator, recipe, model, optimizer, *loaders):
    """accelerate's prepare of the model (unless `wrap_first` wrapped it), the optimizer and the data
    loaders (a None loader stays None): (model, optimizer, *loaders). Under Ulysses the loaders are prepared apart
    from the model, so that accelerate slices none of them: the train loader is sliced by SequenceShards, and eval
    runs whole sequences on each process (accelerate registers the attention with disable_in_eval)."""
    given = [loader for loader in loaders if loader is not None]
    check_ring(accelerator, recipe)  # (ring attention: accelerate hooks the model in prepare, the loop cuts batches)
    apart = check_sequence_parallel(accelerator, recipe, getattr(model, "config", None)) > 1  # (before DeepSpeed's own checks)
    objects = ([] if _fsdp1(accelerator, recipe) else [model]) + [optimizer] + ([] if apart else given)
    prepared = accelerator.prepare(*objects)
    prepared = list(prepared) if len(objects) > 1 else [prepared]
    if apart and given:
        done = accelerator.prepare(*given)
        prepared += list(done) if len(given) > 1 else [done]
    if len(prepared) == len(given) + 1:  # FSDP1: the model was prepared already
        prepared.insert(0, model)
    rest = iter(prepared[2:])
    out = [prepared[0], prepared[1], *(next(rest) if loader is not None else None for loader in loaders)]
    if apart and out[2] is not None:
        out[2] = SequenceShards(out[2], accelerator, out[0])
    return tuple(out)
