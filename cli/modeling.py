"""Model side of the loop: the Accelerator for this machine, tokenizer and model loading (hub id,
local folder, or the embedded tiny default), LoRA, gradient checkpointing, the optimizer, the loss."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from .errors import RecipeError

EMBEDDED_MODEL = Path(__file__).resolve().parent / "data" / "tiny-llama"


def make_accelerator(recipe, **kwargs):
    """The Accelerator for the config accelerate launched us with, made to work on CPU too.

    On a machine without CUDA two accelerate paths need help (measured, see docs/loop.md):
    - DeepSpeed: accelerate finds no backend and would run every rank as a lone process 0;
      a gloo process group fixes the world size and ranks.
    - FSDP: accelerate turns FSDP on only for GPU-like distributed types; the process state is
      set up for CPU (gloo) and marked MULTI_GPU so the FSDP plugin takes over, with device `cpu`.
    """
    from accelerate import Accelerator, PartialState
    from accelerate.utils import (DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin,
                                  InitProcessGroupKwargs)

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handlers = list(kwargs.pop("kwargs_handlers", []))
    if not torch.cuda.is_available() and launched:
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true":
            handlers.append(InitProcessGroupKwargs(backend="gloo"))
        elif os.environ.get("ACCELERATE_USE_FSDP", "false") == "true":
            state = PartialState(cpu=True)
            state.distributed_type = DistributedType.MULTI_GPU
    # Windows of micro batches are built by the loop, so accelerate must not sync on its own at the
    # end of the dataloader (that would cut the window short).
    plugin = GradientAccumulationPlugin(num_steps=recipe.gradient_accumulation_steps, sync_with_dataloader=False)
    # A seeded sampler: every epoch's shuffle is reproducible, and the same on every process.
    data = DataLoaderConfiguration(use_seedable_sampler=True)
    return Accelerator(gradient_accumulation_plugin=plugin, dataloader_config=data, kwargs_handlers=handlers, **kwargs)


def embedded_model(timeout: float = 600.0) -> str:
    """The embedded tiny Llama, saved like a hub model in a cache folder, so that it loads through
    the real from_pretrained path and a LoRA adapter has a base to point at.

    Built before any process group exists (under ZeRO-3 a lone rank building a model would wait
    for the others forever): each machine's local rank 0 builds it from the shipped config with a
    fixed seed and renames it into place; the other ranks wait for it to appear.
    """
    import hashlib
    import time

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    digest = hashlib.sha256(torch.__version__.encode())
    for name in ("config.json", "tokenizer.json"):
        digest.update((EMBEDDED_MODEL / name).read_bytes())
    cache = Path(os.environ.get("MEMRECIPE_CACHE", Path.home() / ".cache" / "memrecipe"))
    folder = cache / f"tiny-llama-{digest.hexdigest()[:12]}"
    if not folder.is_dir() and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        staging = cache / f".{folder.name}.{os.getpid()}"
        config = AutoConfig.from_pretrained(EMBEDDED_MODEL)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(EMBEDDED_MODEL).save_pretrained(staging)
        try:
            staging.rename(folder)  # atomic: readers see no folder or a complete one
        except OSError:  # another machine's rank built it first: the same weights
            shutil.rmtree(staging, ignore_errors=True)
    deadline = time.monotonic() + timeout
    while not folder.is_dir():
        if time.monotonic() > deadline:
            raise RecipeError(f"the embedded model did not appear in {folder} within {timeout:.0f} s")
        time.sleep(0.2)
    return str(folder)


def check_model(name_or_path: str, trust_remote_code: bool = False):
    """The model's config, or a one-line error: missing path, offline, gated, remote code, not a causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if name_or_path.startswith((".", "/", "~")) and not Path(name_or_path).expanduser().exists():
        raise RecipeError(f"model path {name_or_path} does not exist")
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers and the hub raise many kinds; name the likely cause
        text = " ".join(str(e).split())
        low = text.lower()
        if "trust_remote_code" in low:
            raise RecipeError(f"model {name_or_path} runs its own code from the hub: set trust_remote_code=true "
                              "if you trust it") from None
        if "gated" in low or "401" in low or "403" in low:
            raise RecipeError(f"model {name_or_path} is gated: accept its licence on the hub and set HF_TOKEN") from None
        if "offline" in low or "connect" in low or "not a valid model identifier" in low or "not found" in low:
            raise RecipeError(f"model {name_or_path} is neither a local folder nor reachable on the hub "
                              "(offline, or a typo?)") from None
        raise RecipeError(f"cannot read the config of model {name_or_path}: {text[:300]}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not trust_remote_code:
        raise RecipeError(f"model {name_or_path} ({config.model_type}) is not a causal language model")
    return config


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:  # padding is masked out of the loss, any token will do
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(recipe, name_or_path: str, precision: str):
    """from_pretrained with the recipe's memory techniques: LoRA, gradient checkpointing, dtype."""
    from transformers import AutoModelForCausalLM

    # A frozen LoRA base is stored in the compute dtype (2 bytes/param); trained weights stay fp32
    # masters and mixed precision casts them for compute.
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    dtype = half if recipe.lora and half is not None else torch.float32
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, attn_implementation=recipe.attn_implementation,
                                                 trust_remote_code=recipe.trust_remote_code)
    model.config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    if recipe.gradient_checkpointing:
        # non-reentrant: works with frozen inputs (LoRA) and with FSDP/DeepSpeed
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if recipe.lora:
        from peft import LoraConfig, get_peft_model

        lora = recipe.lora
        targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
        model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                 target_modules=targets, task_type="CAUSAL_LM"))
    return model


def make_optimizer(recipe, model, accelerator):
    """AdamW as the recipe says: torch, bitsandbytes 8-bit (paged on CUDA), or DeepSpeed's CPU Adam
    when DeepSpeed offloads the optimizer (it refuses a client optimizer on offloaded state)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]  # norms and biases
    groups = [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    ds = recipe.deepspeed
    if ds is not None and ds.offload_optimizer != "none":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=recipe.learning_rate, adamw_mode=True)
    if recipe.optim in ("adamw_bnb_8bit", "paged_adamw_8bit"):
        import bitsandbytes as bnb

        paged = recipe.optim == "paged_adamw_8bit" and accelerator.device.type == "cuda"  # paging needs CUDA
        cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
        return cls(groups, lr=recipe.learning_rate)
    return torch.optim.AdamW(groups, lr=recipe.learning_rate)


def token_loss(logits: torch.Tensor, labels: torch.Tensor, per_sequence: bool = False) -> torch.Tensor:
    """Next-token cross-entropy summed over target tokens (labels != -100), in fp32: one number,
    or one per sequence."""
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                               ignore_index=-100, reduction="none")
    return losses.view(labels.shape[0], -1).sum(-1) if per_sequence else losses.sum()


def count_targets(labels: torch.Tensor, per_sequence: bool = False):
    """Target tokens (those the loss counts): one int, or a tensor with one count per sequence."""
    mask = labels[:, 1:] != -100
    return mask.sum(-1) if per_sequence else int(mask.sum())
