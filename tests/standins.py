"""CUDA kernels stood in for on CPU by what they allocate: a torch.autograd.Function per kernel whose forward saves
and whose backward allocates the tensors the CUDA kernel's source does, in its dtypes and shapes, so that the CPU
profiler's peak over a step is the GPU allocator's. The values are not the kernel's (zeros): these measure memory,
nothing else. Registered as transformers attention functions (`use(model, name)`)."""

import torch


class FlashAttention2(torch.autograd.Function):
    """flash-attn 2 (csrc/flash_attn/flash_api.cpp). mha_fwd returns out [b, L, h, d] and softmax_lse fp32 [b, h, L],
    and the autograd function keeps q, k, v, out and softmax_lse. mha_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv)
    takes dout (alive throughout: it is the backward's argument), allocates dq, dk and dv (k's and v's heads), under
    GQA dk_expanded and dv_expanded at every query head, the fp32 dq_accum [b, L, h, d] (seqlen rounded up to 128)
    and softmax_d fp32 [b, h, L], runs the kernel, then sums the expanded gradients into dk and dv (at::sum_out)."""

    @staticmethod
    def forward(ctx, q, k, v):  # q [b, h, L, d], k and v [b, kv, L, d], as transformers hands them over
        b, h, length, d = q.shape
        out = q.new_zeros(b, length, h, d)
        lse = torch.zeros(b, h, length, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        b, h, length, d = q.shape
        kv = k.shape[1]
        dq = q.new_zeros(b, length, h, d)
        dk, dv = k.new_zeros(b, length, kv, d), v.new_zeros(b, length, kv, d)
        expanded = [k.new_zeros(b, length, h, d), v.new_zeros(b, length, h, d)] if kv != h else []
        rounded = -(-length // 128) * 128
        dq_accum = torch.zeros(b, rounded, h, d, dtype=torch.float32)
        softmax_d = torch.zeros(b, h, rounded, dtype=torch.float32)
        if expanded:
            torch.sum(expanded[0].view(b, length, kv, h // kv, d), 3, out=dk)
            torch.sum(expanded[1].view(b, length, kv, h // kv, d), 3, out=dv)
        del dq_accum, softmax_d, expanded
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def flash_attention_2(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function interface: out [b, L, h, d], no weights."""
    return FlashAttention2.apply(query, key, value), None


KERNELS = {"standin_flash_attention_2": flash_attention_2}


def use(model, name: str) -> None:
    """Run `model`'s attention through the stand-in `name` (registered with transformers' AttentionInterface)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, KERNELS[name])
    model.config._attn_implementation = name
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name
