"""A model's structure read from its real modules on the meta device (no memory): for the model types the
planner has no reader of its own (memrecipe.planning.architecture), and for what peft's LoRA wraps."""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import torch

from ..errors import RecipeError
from ..planning.architecture import Linear, Structure, Tensor, layer_windows
from .adapters import lora_config


def first_sentence(text: str, limit: int = 200) -> str:
    """A library's message, its first sentence only (transformers follows an unknown model type with every known
    one), and cut at a word, never inside one."""
    text = " ".join(text.split())
    head = text.split(". ")[0].rstrip(".")
    if len(head) <= limit:
        return head
    return head[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


def structure_from_meta(c: dict) -> Structure:
    """Any causal LM: build it without memory on the meta device and read its modules."""
    try:
        model = meta_model(c)
        config = model.config
    except Exception as e:
        raise RecipeError(f"model type {c.get('model_type')!r} is not a causal language model transformers can "
                          f"build ({first_sentence(str(e))})") from None
    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len, default=None)
    if blocks is None or len(blocks) == 0:
        raise RecipeError(f"cannot find the decoder layers of model type {c.get('model_type')!r}")
    in_blocks = {id(p) for p in blocks.parameters()}
    top = tuple(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    h = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", 1)
    kv = getattr(config, "num_key_value_heads", heads) or heads
    d = getattr(config, "head_dim", None) or (h or 0) // heads
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    # every block, in groups of identical ones (a mixture of experts may start with dense layers; sliding-window
    # layers beside full ones): one block of each group is read, so a 61-layer config costs two reads
    windows = layer_windows(config.to_dict())
    kinds: dict[tuple, list[int]] = {}
    for index, block in enumerate(blocks):
        shapes = tuple((n, tuple(p.shape)) for n, p in block.named_parameters())
        kinds.setdefault((shapes, windows[index] if index < len(windows) else 0), []).append(index)
    groups = []
    for (_, window), indices in kinds.items():
        layer = blocks[indices[0]]
        linears = tuple(Linear(name.rsplit(".", 1)[-1], m.in_features, m.out_features, m.bias is not None)
                        for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear))
        in_linears = {id(p) for m in layer.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()}
        other = tuple(p.numel() for p in layer.parameters() if id(p) not in in_linears)  # norms, fused experts
        fused = [p for p in layer.parameters() if p.dim() == 3]  # experts as [experts x out x in] tensors
        experts = fused[0].shape[0] if fused else 0
        top_k = (getattr(config, "num_experts_per_tok", None) or 1) if experts else 0
        i = (getattr(config, "moe_intermediate_size", None) if experts else None) or \
            getattr(config, "intermediate_size", None) or max(lin.out_features for lin in linears)
        gated = any("gate" in lin.name for lin in linears) or any(p.shape[1] == 2 * i for p in fused)
        groups.append(Structure(config.model_type, config.vocab_size, h or linears[0].in_features, len(indices),
                                heads, kv, d, i, gated, linears, other, (),
                                bool(getattr(config, "tie_word_embeddings", False)), llama_like=False, experts=experts,
                                top_k=top_k, expert_params=sum(p.numel() for p in fused), config=c, first=indices[0],
                                window=window))
    # the model's own per-layer fields: its routed layers' (its biggest group's if none routes)
    main = max(groups, key=lambda g: (g.experts > 0, g.layers))
    notes = ["structure read from the meta device"]
    if main.experts:
        dense = sum(g.layers for g in groups if not g.experts)
        notes.append(f"mixture of experts: {main.experts} experts per layer in fused tensors, {main.top_k} per token"
                     + (f"; {dense} of its {len(blocks)} layers are dense" if dense else ""))
    kernels = {"sdpa": getattr(model, "_supports_sdpa", True), "flex": getattr(model, "_supports_flex_attn", True),
               "attention_dropout": float(getattr(config, "attention_dropout", 0) or 0)}
    groups = [replace(g, **kernels) for g in groups]
    main = replace(main, **kernels)
    return replace(main, layers=len(blocks), top_params=top, notes=tuple(notes), largest=largest,
                   blocks=tuple(groups) if len(groups) > 1 else (), first=0)


def meta_model(c: dict):
    """The model of a config dict on the meta device: its real modules, no memory."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights(include_buffers=True):  # buffers too: DeepSeek-V3 would allocate 28 GiB of them
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**c))
    model.tie_weights()  # skipped on the meta device; a real model shares its embeddings
    return model


@functools.lru_cache(maxsize=32)  # `plan` asks once per recipe
def lora_tensors(config_json: str, lora) -> tuple[Tensor, ...]:
    """The tensors peft's LoRA trains on a config's model (a JSON string: cached per config and section)."""
    model = meta_model(json.loads(config_json))
    try:
        from peft import get_peft_model

        wrapped = get_peft_model(model, lora_config(lora))
    except ValueError as e:
        text = " ".join(str(e).split())
        if "lora_dropout" in text:
            raise RecipeError("lora.dropout must be 0 for this model: peft adapts its fused expert tensors (ParamWrapper), "
                              "which take no dropout (set lora.dropout=0)") from None
        raise RecipeError(f"peft cannot add this recipe's LoRA to the model: {text[:200]}") from None
    return tuple(Tensor(name.rsplit(".", 1)[0], tuple(p.shape), "embedding" if "embed" in name else "other")
                 for name, p in wrapped.named_parameters() if p.requires_grad)
