"""LoRA through peft: the recipe's adapters, or a saved adapter trained on (with its frozen copy for DPO), and
PiSSA/OLoRA's initial adapter kept to convert the final one back."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint


def lora_config(lora):
    """peft's LoraConfig for the recipe's lora: section (the same names)."""
    from peft import LoraConfig

    listed = lambda names: names if isinstance(names, str) or names is None else list(names)  # noqa: E731
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=listed(lora.target_modules), modules_to_save=listed(lora.modules_to_save),  # pyright: ignore[reportArgumentType]  (peft takes a str too)
                      use_dora=lora.use_dora, use_rslora=lora.use_rslora, init_lora_weights=lora.init_lora_weights,
                      bias=lora.bias, task_type="CAUSAL_LM")


REFERENCE_ADAPTER = "reference"  # a saved adapter's frozen copy beside the one that trains (DPO's reference model)


def add_lora(model, lora, reference: bool = False, accelerator=None, compiled: bool = False, redraw: bool = True):
    """The model with peft's adapters: new ones, or a saved adapter's weights to train on (`lora.adapter`) and, with
    `reference`, a frozen copy of them beside it (named REFERENCE_ADAPTER: under DPO the reference is the model
    the adapter makes, as TRL's ref_adapter_name; a few MB, no second model). Everything that trains is fp32, as
    the adapters are: peft upcasts its adapter layers, not the copies of modules_to_save nor the biases that
    `bias` trains, which would otherwise take AdamW's updates in the base's 16 bits. `accelerator`: the run's. Under
    DeepSpeed's 16-bit engine (engine_dtype), which keeps fp32 master weights of what trains in its optimizer and
    computes in 16 bits, what trains is held in that dtype, as the engine casts a model itself (engine.py,
    _cast_module_mixed_precision) except one ZeRO-3 built partitioned (zero.Init), where fp32 adapters without
    autocast cast every adapter's input to fp32 and keep that copy (measured on CPU: a layer's saved bytes 1.6x, 2.3x
    with dropout). Elsewhere in 16 bits the forward runs under autocast (accelerate's native_amp). Under either the
    adapters read their input as it comes (share_inputs); with `redraw` (the loop passes `not
    Recipe.keeps_dropout`, the rule the plan counts by) they also redraw their dropout in backward, in 16 bits only
    (a copied script's launch config may turn them off). Under ZeRO-3 the redraw reads the adapter's weight in the
    adapter's own backward, which ZeRO gathers for it (its pre-backward hook on the adapter's output; measured through
    `memrecipe run` with every weight partitioned: the losses and adapters bitwise peft's dropout's). Kept as peft's
    when `compiled` (the compiler's handling of random ops inside a checkpoint is not checked here), in fp32 and with
    `lora.redraw_dropout: false`. `compiled`: the layers will be compiled."""
    from peft import PeftModel, get_peft_model

    if lora.adapter:
        model = PeftModel.from_pretrained(model, lora.adapter, is_trainable=True, config=lora_config(lora))
        if reference:
            model.load_adapter(lora.adapter, adapter_name=REFERENCE_ADAPTER, is_trainable=False)
    else:
        model = get_peft_model(model, lora_config(lora))
    autocast, half = bool(accelerator and accelerator.native_amp), engine_dtype(accelerator) if accelerator else None
    trained = half or torch.float32
    for name, p in model.named_parameters():  # (under the engine the frozen reference adapter too: no autocast
        # casts its input for it)
        moved = p.requires_grad or (half and ".lora_" in name)
        if moved and p.dtype in (torch.bfloat16, torch.float16, torch.float32) and p.dtype != trained:
            p.data = p.data.to(trained)
    if autocast or half:
        share_inputs(model, redraw=redraw)
    if not compiled:  # (compiled, every layer's input requires grad, the first's too: one graph serves them all)
        drop_input_grads(model)
    return model


def engine_dtype(accelerator) -> torch.dtype | None:
    """The 16-bit dtype DeepSpeed's engine computes in (its model runs in it, without autocast: accelerate's
    native_amp is off under DeepSpeed); None under any other engine, or in fp32."""
    if accelerator.distributed_type.value != "DEEPSPEED":
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)


def drop_input_grads(model) -> int:
    """Remove the forward hooks that mark the input embedding's output as requiring grad; returns how many.
    transformers' checkpointing (activation_checkpointing_enable) and peft (PeftModel's and k-bit preparation) add them
    for reentrant checkpointing, which needs an input that requires grad. The loop's checkpointing is non-reentrant
    (and so is FSDP's wrapper, as accelerate applies it), which needs none; a frozen embedding's output made to require
    grad is a leaf autograd holds to the end of backward, one [tokens x hidden] past what the activation offload
    moves to host memory (4.4 GiB of an 8B at 565K tokens). peft's call replaces transformers' list of its hooks, so
    the hooks are found on the module. A trained embedding's output requires grad anyway. (Kept when the layers will
    be compiled: with the first layer's input requiring grad as the others' do, one graph serves every layer.)"""
    hooks = model.get_input_embeddings()._forward_hooks
    marking = [key for key, hook in hooks.items() if getattr(hook, "__name__", "").startswith("make_inputs_require_grad")]
    for key in marking:
        del hooks[key]
    return len(marking)


def share_inputs(model, redraw: bool = True) -> None:
    """Adapters read their layer's input as it comes, under autocast: peft casts each adapter's input to the
    adapter's fp32 first (tuners_utils._cast_input_dtype), and autocast casts it back to 16 bits for the matmul, which
    saves that copy for backward: each adapter kept its own [tokens x in] copy (q, k and v three of the same tensor)
    and made an fp32 one on the way (the step's peak, in the layer's recompute). Without the casts the adapters
    reading one tensor save that one tensor. With dropout, each adapter's cast, dropout and A run inside a checkpoint
    of their own (recompute_dropout): the same masks from the same random state, nothing kept but the shared input.
    The same values reach every matmul: loss and gradients are bitwise peft's (tests/unit/training/test_adapters.py).
    Only for a forward under autocast (the fp32 adapters' matmul needs it), or with adapters in the 16 bits their input
    comes in (DeepSpeed's engine, add_lora); the run's setup counts the layers and
    adapters changed (facts.describe_setup: lora_shared_inputs, lora_recomputed_dropout)."""
    from peft.tuners.lora import LoraLayer

    layers = layer_casts()
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        casts = layers.get(type(module)) if redraw else None
        for name, dropout in module.lora_dropout.items():
            if casts and isinstance(dropout, torch.nn.Dropout) and name not in module.lora_variant:  # vanilla LoRA
                recompute_dropout(module, name, casts)
        if all(isinstance(d, torch.nn.Identity) for d in module.lora_dropout.values()):
            module.cast_input_dtype_enabled = False


def layer_casts() -> dict:
    """peft's LoRA layers whose forward recompute_dropout reproduces -> when each casts an adapter's input to the
    adapter's dtype: peft/tuners/lora/layer.py's Linear always; bitsandbytes' (peft/tuners/lora/bnb.py) only outside
    CUDA autocast (`requires_conversion = not torch.is_autocast_enabled()`)."""
    from peft.tuners.lora import bnb, layer

    outside_cuda_autocast = lambda: not torch.is_autocast_enabled()  # noqa: E731 (the device-less form: CUDA's)
    return {layer.Linear: lambda: True, **{getattr(bnb, name): outside_cuda_autocast
                                           for name in ("Linear4bit", "Linear8bitLt") if hasattr(bnb, name)}}


def recompute_dropout(layer, name: str, casts) -> None:
    """The adapter `name` of a peft LoRA layer runs its input's cast (where the layer's own forward casts: `casts`),
    its dropout and its A as one checkpoint (torch.utils.checkpoint, non-reentrant: the random state kept, so
    backward redraws the forward's masks): peft's ops in peft's order, keeping only the input, where peft's kept
    the dropout's mask and autocast's 16-bit copy of its output for every adapter. The dropout module moves under A
    (still switched by train/eval)."""
    linear = layer.lora_A[name]
    linear.input_dropout = layer.lora_dropout[name]
    layer.lora_dropout[name] = torch.nn.Identity()
    linear.forward = functools.partial(dropped_forward, linear, casts)


def dropped_forward(linear, casts, x):
    return checkpoint(dropped, linear, casts(), x, use_reentrant=False)


def dropped(linear, cast: bool, x):
    return torch.nn.Linear.forward(linear, linear.input_dropout(x.to(linear.weight.dtype) if cast else x))


def rewrites_base(recipe) -> bool:
    """LoRA inits that change the base weights (pissa, olora): the saved adapter is converted back."""
    return recipe.lora is not None and recipe.lora.init_lora_weights in ("pissa", "olora")


def save_initial_adapter(model, folder: Path) -> None:
    """The adapter as initialized, before training: what peft subtracts to convert a PiSSA/OLoRA adapter
    into one that applies to the original base. Saved with init_lora_weights true, as peft asks, so
    that loading it does not decompose the base again."""
    config = model.peft_config["default"]
    init, config.init_lora_weights = config.init_lora_weights, True
    try:
        model.save_pretrained(folder)
    finally:
        config.init_lora_weights = init


def keep_initial_adapter(model, recipe, folder: Path, main_process: bool = True) -> Path | None:
    """PiSSA/OLoRA (`rewrites_base`): the adapter as initialized, saved once (by the main process) into `folder`
    before training, to convert the final adapter back to one for the original base (save_final). None for
    every other LoRA init and for full fine-tunes: nothing to convert."""
    if not rewrites_base(recipe):
        return None
    if main_process and not folder.exists():
        save_initial_adapter(model, folder)
    return folder
