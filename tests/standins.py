"""CUDA kernels stood in for on CPU by what they allocate: a torch.autograd.Function per kernel whose forward saves
and whose backward allocates the tensors the CUDA kernel's source does, in its dtypes and shapes, so that the CPU
profiler's peak over a step is the GPU allocator's. The values are not the kernel's (zeros): these measure memory,
nothing else. Registered as transformers attention functions (`use(model, name)`)."""

import torch


def saved_output(ctx, q, k, v):
    """The attention's output [b, L, h, d] and its fp32 logsumexp [b, h, L], kept with q, k and v (q [b, h, L, d], k
    and v [b, kv, L, d], as transformers hands them over)."""
    b, h, length, d = q.shape
    out = q.new_zeros(b, length, h, d)
    ctx.save_for_backward(q, k, v, out, torch.zeros(b, h, length, dtype=torch.float32))
    return out


def gradients(q, k):
    """dq at the query's heads, dk and dv at K's and V's own, each [b, length, heads, d] in memory."""
    b, h, length, d = q.shape
    kv, keys = k.shape[1], k.shape[2]
    return q.new_zeros(b, length, h, d), k.new_zeros(b, keys, kv, d), k.new_zeros(b, keys, kv, d)


class FlashAttention2(torch.autograd.Function):
    """flash-attn 2 (csrc/flash_attn/flash_api.cpp). mha_fwd returns out [b, L, h, d] and softmax_lse fp32 [b, h, L],
    and the autograd function keeps q, k, v, out and softmax_lse. mha_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv)
    takes dout (alive throughout: it is the backward's argument) and allocates what mha_bwd (below) does."""

    @staticmethod
    def forward(ctx, q, k, v):
        return saved_output(ctx, q, k, v)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors  # (flash_attn_interface: every saved tensor held to the end)
        return mha_bwd(q, k)


def mha_bwd(q, k):
    """What flash_api.cpp's mha_bwd allocates for q [b, h, c, d] and k [b, kv, keys, d] (as transformers hands them
    over), and returns: dq, dk and dv ([b, c, h, d] and [b, keys, kv, d] in memory), under GQA dk_expanded and
    dv_expanded at every query head, the fp32 dq_accum [b, c rounded up to 128, h, d rounded up to 32] and softmax_d
    fp32 [b, h, c rounded], then the expanded gradients summed into dk and dv (at::sum_out)."""
    b, h, c, d = q.shape
    kv, keys = k.shape[1], k.shape[2]
    dq, dk, dv = gradients(q, k)
    expanded = [k.new_zeros(b, keys, h, d), k.new_zeros(b, keys, h, d)] if kv != h else []
    rounded = -(-c // 128) * 128
    dq_accum = torch.zeros(b, rounded, h, -(-d // 32) * 32, dtype=torch.float32)
    softmax_d = torch.zeros(b, h, rounded, dtype=torch.float32)
    if expanded:
        torch.sum(expanded[0].view(b, keys, kv, h // kv, d), 3, out=dk)
        torch.sum(expanded[1].view(b, keys, kv, h // kv, d), 3, out=dv)
    del dq_accum, softmax_d, expanded
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class FlexAttention(torch.autograd.Function):
    """flex_attention, compiled (torch/_higher_order_ops/flex_attention.py and torch/_inductor/kernel/flex/
    flex_attention.py). The forward writes out in the query's stride order (infer_dense_strides(out_size,
    q_strides): [b, L, h, d] in memory for transformers' query after RoPE) and the fp32 logsumexp [b, h, L]; the
    compiled graph keeps q, k, v, out and logsumexp (max_scores, an output no backward reads, is not kept). The
    backward (flex_attention_backward) takes dout, makes delta, the fp32 row sums of out x dout [b, h, L], and writes
    dq at the query's heads and dk, dv at K's and V's own heads (no expansion, no fp32 accumulator)."""

    @staticmethod
    def forward(ctx, q, k, v):
        return saved_output(ctx, q, k, v).transpose(1, 2)  # [b, L, h, d] in memory: the query's stride order

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        b, h, length, _ = q.shape
        delta = torch.zeros(b, h, length, dtype=torch.float32)
        del out  # inductor's backward frees each input after its last use (`args.clear()`, then `del`): out's is delta
        dq, dk, dv = gradients(q, k)
        del delta
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def flex_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' integrations/flex_attention.py: out.transpose(1, 2).contiguous() (no copy: out is [b, L, h, d]
    in memory already)."""
    return FlexAttention.apply(query, key, value).transpose(1, 2).contiguous(), None


class FusedDropout(torch.autograd.Function):
    """CUDA's dropout: ATen's fused kernel (Dropout.cpp, is_fused_kernel_acceptable: CUDA inputs only) runs
    native_dropout, whose CUDA kernel (aten/src/ATen/native/cuda/Dropout.cu, dropout_cuda) allocates the output and
    a bool mask and nothing else; its backward (masked_scale) one gradient. CPU's native_dropout makes an fp32 noise
    tensor on the way (measured: 9 bytes an fp32 element at its peak, against CUDA's 5), and F.dropout on CPU keeps
    that noise: neither is CUDA's."""

    @staticmethod
    def forward(ctx, x, p):
        mask = torch.empty(x.shape, dtype=torch.bool).bernoulli_(1 - p)
        out = torch.where(mask, x, 0.0).mul_(1 / (1 - p))  # (torch.mul would cast the mask to x's dtype first)
        ctx.save_for_backward(mask)
        ctx.scale = 1 / (1 - p)
        return out

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return torch.where(mask, grad, 0.0).mul_(ctx.scale), None


class CudaRandomState:
    """torch.cuda.get_rng_state: 16 bytes (CUDAGeneratorImpl::get_state, a Philox seed and offset), where CPU's
    mt19937 state is 5,056: the tiled MLP keeps one per tile (training.tiling.random_state), 0.57 MB over the stand-in
    rows' 112 tiles, which no GPU holds. The CPU state waits as Python bytes, outside torch's allocator, beside a
    16-byte tensor that stands for CUDA's."""

    def __init__(self, state: torch.Tensor):
        self.cpu, self.cuda = state.numpy().tobytes(), torch.empty(16, dtype=torch.uint8)

    @staticmethod
    def get(device):
        return CudaRandomState(torch.get_rng_state())

    @staticmethod
    def set(device, state) -> None:
        torch.set_rng_state(torch.frombuffer(bytearray(state.cpu), dtype=torch.uint8))


def cuda_dropout(input, p=0.5, training=True, inplace=False):
    """F.dropout as CUDA runs it (FusedDropout): patched over torch.nn.functional.dropout."""
    return FusedDropout.apply(input, p) if training and p > 0 else input


class TorchFlash:
    """torch's flash kernel on CUDA as training.query_chunks.CudaFlash calls it, one block of queries and keys a call
    (a sliding window's band of keys, the same kernel's local attention).
    Forward (aten's _scaled_dot_product_flash_attention -> mha_fwd, flash_api.cpp): out = empty_like(q) [b, c, h, d]
    and softmax_lse fp32 [b, h, c]. Backward (_scaled_dot_product_flash_attention_backward -> _flash_attention_backward,
    attention_backward.cu: grad_out and out made contiguous, no copy for one row -> mha_bwd): dq [b, c, h, d], dk and dv
    at K's and V's own heads, under GQA dk_expanded and dv_expanded at every query head, the fp32 dq_accum
    [b, c rounded up to 128, h, d rounded up to 32] and softmax_d fp32 [b, h, c rounded], then the expanded gradients
    summed into dk and dv (at::sum_out)."""

    @staticmethod
    def forward(q, k, v, scale):
        b, h, c, d = q.shape
        return q.new_zeros(b, c, h, d).transpose(1, 2), [torch.zeros(b, h, c, dtype=torch.float32)]

    @staticmethod
    def backward(grad, q, k, v, out, kept, scale, causal):
        grad, out = grad.transpose(1, 2).contiguous(), out.transpose(1, 2).contiguous()
        return mha_bwd(q, k)

    @staticmethod
    def banded(q, k, v, scale, window):
        """A sliding window's chunk against its band of keys (_flash_attention_forward -> mha_fwd): as forward."""
        return TorchFlash.forward(q, k, v, scale)

    @staticmethod
    def banded_backward(grad, q, k, v, out, kept, scale, window):
        """_flash_attention_backward (attention_backward.cu) -> mha_bwd over the chunk's queries and its band's keys."""
        return TorchFlash.backward(grad, q, k, v, out, kept, scale, True)


def use_torch_flash(monkeypatch) -> None:
    """query_chunks' calls through TorchFlash, as on CUDA."""
    from memrecipe.training import query_chunks

    monkeypatch.setattr(query_chunks, "kernel_for", lambda device: TorchFlash)


def flash_attention_2(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function interface: out [b, L, h, d], no weights."""
    return FlashAttention2.apply(query, key, value), None


KERNELS = {"standin_flash_attention_2": flash_attention_2, "standin_flex_attention": flex_attention}


def use_cuda_random_states(monkeypatch) -> None:
    """The tiled MLP's random states as CUDA's size (CudaRandomState)."""
    from memrecipe.training import tiling

    monkeypatch.setattr(tiling, "random_state", CudaRandomState.get)
    monkeypatch.setattr(tiling, "set_random_state", CudaRandomState.set)


def use(model, name: str) -> None:
    """Run `model`'s attention through the stand-in `name` (registered with transformers' AttentionInterface)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, KERNELS[name])
    model.config._attn_implementation = name
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name
