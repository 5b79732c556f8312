"""The model as it is loaded: a hub id, a local folder or the embedded tiny default; its dtype and 4/8-bit
quantization, the attention kernel it runs, and, under FSDP2's cpu_ram_efficient_loading, no weights off rank 0."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from ..errors import RecipeError
from ..planning.registry import EMBEDDED_MODEL, model_cache


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
    cache = model_cache()
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


TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "no": torch.float32,
          "uint8": torch.uint8}


def quantization_config(recipe, precision: str):
    """transformers' BitsAndBytesConfig from the recipe's quantization section."""
    from transformers import BitsAndBytesConfig

    q = recipe.quantization
    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = TORCH_DTYPES[precision if q.compute_dtype == "auto" else q.compute_dtype]
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.quant_type,
                              bnb_4bit_use_double_quant=q.double_quant, bnb_4bit_compute_dtype=compute,
                              bnb_4bit_quant_storage=TORCH_DTYPES[q.quant_storage])


def attention(recipe, name_or_path: str, precision: str, device=None):
    """The attention kernel this process runs (planning.attention.pick_attention), from the facts here: transformers' own
    flash-attn check (package, version, CUDA), Triton for flex_attention's CUDA kernel, and the model: its class
    must support the kernel (transformers refuses otherwise) and flex refuses attention dropout in training."""
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import is_flash_attn_2_available

    from ..planning.architecture import layer_windows, reached_windows
    from ..planning.attention import chunked, offset_limit, offsets_note, pick_attention, unsupported_note

    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=recipe.trust_remote_code)
    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, AttributeError):  # remote code: its class is known once loaded; assume it supports both
        model_class = None
    cuda = device is not None and device.type == "cuda"
    error = flash_import_error() if is_flash_attn_2_available() else None
    flash = is_flash_attn_2_available() and not error and getattr(model_class, "_supports_flash_attn", True)
    has = {"sdpa": getattr(model_class, "_supports_sdpa", True), "flex": getattr(model_class, "_supports_flex_attn", True)}
    flex = (cuda and importlib.util.find_spec("triton") is not None and has["flex"]
            and not getattr(config, "attention_dropout", 0))
    text = config.get_text_config()
    # Ulysses: each process attends to 1/sp of the heads (sp null: every process of the launch)
    heads = max(1, text.num_attention_heads // recipe.sequence_group(int(os.environ.get("WORLD_SIZE", "1"))))
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    tokens = recipe.per_device_train_batch_size * recipe.max_seq_length // recipe.context_parallel
    windows = set(layer_windows(text.to_dict())) or {0}  # (sliding windows; 0: full attention)
    picked = pick_attention(recipe.attn_implementation, cuda=cuda, half=precision in ("bf16", "fp16"),
                            packing=recipe.packing, flash=flash, flex=flex, flash_error=error,
                            sequence_parallel=recipe.sequence_parallel != 1, ring=recipe.context_parallel > 1,
                            past_offsets=tokens > offset_limit(heads, head_dim),
                            windowed=bool(reached_windows(windows, recipe.max_seq_length)), sdpa=has["sdpa"])
    if unsupported := unsupported_note(picked.name, has["sdpa"], has["flex"], text.model_type):
        raise RecipeError(unsupported)
    calls = max(chunked(recipe.query_chunks, picked.name, recipe.packing, recipe.per_device_train_batch_size,
                        recipe.max_seq_length, w) or tokens for w in windows)  # (query chunks: a call's queries)
    wraps = offsets_note(picked.name, calls, heads, head_dim) if cuda else None
    if wraps:  # (a plain accelerate launch meets it here; memrecipe run refused it before launching)
        raise RecipeError(wraps)
    return picked


def flash_import_error() -> str | None:
    """Why flash-attn, found by transformers' package check, does not import here (a wheel built for another torch:
    undefined symbols), or None when it does."""
    try:
        import flash_attn  # noqa: F401  # pyright: ignore[reportMissingImports]  (CUDA boxes only)
    except Exception as e:  # ImportError, OSError: whatever the broken build raises
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return None


def load_pretrained(recipe, name_or_path: str, precision: str, device=None, own_weights: bool = False):
    """from_pretrained in the recipe's weight dtype, and with its quantization (bitsandbytes 4- or 8-bit, quantized
    as it loads): what the base holds. No KV cache (it is for generation). Under FSDP2's cpu_ram_efficient_loading
    the processes but rank 0 build it without weights (rank0_loads), unless `own_weights` (a copy that accelerate
    does not prepare, so that nothing broadcasts into it)."""
    from transformers import AutoModelForCausalLM

    # A frozen LoRA base is stored in the compute dtype (2 bytes/param); trained weights stay fp32
    # masters and mixed precision casts them for compute, unless the recipe trains them in bf16.
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    dtype = half if recipe.lora and half is not None else TORCH_DTYPES[recipe.weight_dtype]
    extra = {}
    q = recipe.quantization
    if q is not None:
        extra["quantization_config"] = quantization_config(recipe, precision)
        if q.quant_storage != "uint8":  # FSDP shards one dtype: the unquantized weights match the 4-bit storage
            dtype = TORCH_DTYPES[q.quant_storage]
        if recipe.fsdp is not None:
            # Under FSDP every rank loads the whole 4-bit model (transformers 5.23 has no "CPU or meta under
            # FSDP" branch any more), and with no device_map the bitsandbytes quantizer would put it on this
            # rank's GPU (quantizers/quantizer_bnb_4bit.py, update_device_map): a 70B at ~39 GB per GPU.
            # Quantized on the host instead, FSDP moves each rank's shards to its GPU, and Params4bit.to moves
            # every weight's quant_state along (bitsandbytes/nn/modules.py, Params4bit.to; FSDP1 moves with
            # `param.data = param.to(device_id)`, torch/distributed/fsdp/_init_utils.py, _move_states_to_device).
            extra["device_map"] = {"": "cpu"}
        elif device is not None and device.type == "cuda":
            extra["device_map"] = {"": device}  # quantize straight onto this process's GPU
    kernel = attention(recipe, name_or_path, precision, device)  # attn_implementation: auto, resolved here
    config = model_config(recipe, name_or_path)  # (rope_scaling applied)
    if q is None and not own_weights and rank0_loads(recipe):
        model = without_weights(name_or_path, dtype, kernel.name, recipe.trust_remote_code, config)
    else:
        # use_kernels=False: from transformers 5.25 hub kernels are on by default, and every model.train() then
        # re-kernelizes, resetting each RMSNorm's forward (lean_norms' undone, silently) and, on a GPU, swapping in
        # Liger's RMSNorm and a rotary kernel from the hub: kernels the plan does not count and offline GPUs lack
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, attn_implementation=kernel.name,
                                                     trust_remote_code=recipe.trust_remote_code, config=config,
                                                     use_kernels=False, **extra)
    model.memrecipe_attention = kernel  # pyright: ignore[reportArgumentType]  (a plain attribute, not a submodule): why this kernel, for the start-up log and the report (facts.describe_setup)
    model.config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    if q is not None and q.upcast_unquantized:
        from peft import prepare_model_for_kbit_training

        # PEFT's QLoRA preparation: unquantized weights (norms, embeddings, head) to fp32, and with them
        # the residual stream. Off by default: they stay in 16 bits (LoRA then trains the same way as
        # on a bf16 base; non-reentrant checkpointing needs no input gradients, which PEFT also sets up).
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if q is not None and (device is None or device.type == "cpu"):
        # On CPUs with AVX512-BF16, bitsandbytes 0.50 repacks 4-bit weights for inference in place at
        # the first no-grad eval forward: it fails when in_features is not a multiple of 64, and
        # training would go on with inference-packed weights. Keep the training layout.
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False  # pyright: ignore[reportArgumentType]  (a flag)
    return model


def rank0_loads(recipe) -> bool:
    """This process builds the model without its weights, which FSDP2 then receives from rank 0 as shards: the launch
    config's cpu_ram_efficient_loading (the FSDP plugin has set FSDP_CPU_RAM_EFFICIENT_LOADING by now), on a process
    other than the global rank 0, whose full state dict accelerate broadcasts (fsdp2_load_full_state_dict, src 0).
    transformers 5 loads every rank's weights itself, so without this each process holds the whole model once."""
    from accelerate.utils import str_to_bool

    return (recipe.fsdp is not None and recipe.fsdp.version == 2 and int(os.environ.get("RANK", "0")) != 0
            and str_to_bool(os.environ.get("ACCELERATE_USE_FSDP", "false")) == 1
            and str_to_bool(os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")) == 1)


def model_config(recipe, name_or_path: str):
    """The model's config with the recipe's rope_scaling written into its rope_parameters (and max_position_embeddings
    set to the positions they reach: planning.positions), so that the rotary frequencies are built scaled and the saved
    and exported models carry them; None without rope_scaling (from_pretrained reads the config itself)."""
    if recipe.rope_scaling is None:
        return None
    from transformers import AutoConfig

    from ..planning.positions import rope_parameters

    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=recipe.trust_remote_code)
    text = config.get_text_config()
    rope = rope_parameters(recipe, text.to_dict())
    text.max_position_embeddings = rope.pop("max_position_embeddings")
    text.rope_parameters = rope
    return config


def without_weights(name_or_path: str, dtype, attn_implementation: str, trust_remote_code: bool, config=None):
    """The model built from its config with storage for its parameters that nothing writes (untouched pages hold no
    host RAM), its buffers computed as usual (the rotary frequencies: FSDP2 does not broadcast non-persistent
    buffers). Tied weights stay tied."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = config or AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, buffers real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
    made = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
    return model
