"""Lean RMSNorm: the same normalisation, computed a tile of tokens at a time, keeping only its input and one fp32
number per token for backward. transformers' RMSNorm (Llama's and the models that copy it) upcasts its input to fp32
and autograd keeps that copy (4 bytes an element where the residual stream is 16-bit), and its backward works in fp32
over the whole sequence (five [tokens x hidden] buffers): at long context, the largest of one layer's backward
buffers (docs/long-context.md). Liger's fused RMSNorm kernel does the same on GPUs with Triton; this one is plain
torch, so it runs everywhere the loop does. The forward is the module's own ops, tile by tile (bitwise the same
output); the backward is the closed form of their gradient, in fp32 (equal to autograd's to rounding)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..planning.activations import norm_rows


class LeanRMSNorm(torch.autograd.Function):
    """y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), `rows` tokens at a time; saves x and the rsqrt."""

    @staticmethod
    def forward(ctx, x, weight, eps, rows):
        flat = x.reshape(-1, x.shape[-1])
        out = flat.new_empty(flat.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
        scale = flat.new_empty((flat.shape[0], 1), dtype=torch.float32)
        for start in range(0, flat.shape[0], rows):
            part = flat[start:start + rows].to(torch.float32)  # transformers' LlamaRMSNorm.forward, op for op
            variance = part.pow(2).mean(-1, keepdim=True)
            scale[start:start + rows] = torch.rsqrt(variance + eps)
            out[start:start + rows] = weight * (part * scale[start:start + rows]).to(x.dtype)
        ctx.save_for_backward(x, weight, scale)
        ctx.rows = rows
        return out.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        x, weight, scale = ctx.saved_tensors
        flat, grads = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        want_x, want_weight = ctx.needs_input_grad[:2]
        grad_x = torch.empty_like(flat) if want_x else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, flat.shape[0], ctx.rows):
            rsqrt = scale[start:start + ctx.rows]
            normed = flat[start:start + ctx.rows].to(torch.float32) * rsqrt
            part = grads[start:start + ctx.rows]
            if want_weight:  # autograd's product in the output's dtype, summed over the tokens in fp32
                grad_weight += (part * normed.to(x.dtype)).to(torch.float32).sum(0)
            if want_x:  # d/dx of x * rsqrt(mean(x^2) + eps), through the cast (whose gradient is in x's dtype)
                upstream = (part * weight).to(x.dtype).to(torch.float32)
                mean = (upstream * normed).mean(-1, keepdim=True)
                grad_x[start:start + ctx.rows] = rsqrt * (upstream - normed * mean)
        return (grad_x.view_as(x) if want_x else None, grad_weight.to(weight.dtype) if want_weight else None,
                None, None)


def lean_forward(norm: nn.Module, hidden: int, x: torch.Tensor) -> torch.Tensor:
    return LeanRMSNorm.apply(x, norm.weight, norm.variance_epsilon, norm_rows(x.shape[-1], hidden))


def is_llama_norm(module: nn.Module) -> bool:
    """A norm whose forward is transformers' LlamaRMSNorm.forward, op for op (Qwen2/3, Mistral, Mixtral, Phi-3, OLMoE,
    Granite, DeepSeek-V3 copy it; Gemma's adds 1 to its weight, OLMo2's casts elsewhere: those are left as they are)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ours, theirs = type(module).forward.__code__, LlamaRMSNorm.forward.__code__
    return (ours.co_code, ours.co_names, ours.co_consts) == (theirs.co_code, theirs.co_names, theirs.co_consts)


def lean_norms(model: nn.Module) -> int:
    """Every Llama-style RMSNorm of the model runs as LeanRMSNorm, in tiles of hidden_size tokens; returns how many."""
    hidden = model.config.get_text_config().hidden_size  # pyright: ignore[reportCallIssue, reportAttributeAccessIssue]  (a PreTrainedModel's)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and is_llama_norm(m)]
    for norm in norms:
        norm.forward = functools.partial(lean_forward, norm, hidden)
    return len(norms)


def apply(model, recipe, accelerator) -> int:
    """The lean norms rung (planning/rungs.py): every Llama-style RMSNorm lean; returns how many."""
    return lean_norms(model)
