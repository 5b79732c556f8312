"""Attention a chunk of queries at a time (the `query_chunks` rung), exact: forward, each chunk of a row's queries
against every key before its end, causal from the bottom right (each chunk sees all its keys, so its output needs no
log-sum-exp merge); backward, each chunk of queries against each chunk of keys it sees (QueryChunkedAttention).

Why, on CUDA (torch 2.13's copy of flash-attn 2, which sdpa runs there):
- the backward's fp32 dq accumulator is addressed with 32-bit offsets (planning.attention.offset_limit: 524,288
  queries at 32 heads x 128); in chunks its offsets stay within a chunk. The key side is addressed in 64 bits
  (flash_bwd_kernel.h: the dk/dv row offsets are index_t), and torch launches only the key-parallel backward
  (flash_bwd_launch_template.h, run_flash_bwd: run_flash_bwd_seqk_parallel);
- the backward's buffers (flash_api.cpp, mha_bwd: dq_accum and softmax_d over the queries, dK and dV at every query
  head under GQA over the keys) hold a chunk of each, not the sequence: at Llama-3.1-8B's widths 52 KB a token of
  one layer's backward becomes 24 (planning.activations.attention_backward_bytes).
Each forward call is the kernel sdpa runs (aten's _scaled_dot_product_flash_attention with is_causal, which flash
reads from the bottom right when there are more keys than queries: torch's CausalBias calls it so), each backward
call that kernel's backward.

On CPU the same chunks run torch's CPU flash kernel (no 32-bit limit there: the rung runs so that the suite and the
smoke tests train through it), a chunk's forward in two calls merged by log-sum-exp (CpuFlash: CPU's is_causal reads
from the top left). Rows with a mask (packed or padded) go to transformers' sdpa as they are.

A sliding-window layer (Mistral's, the Qwens', Gemma 3's: each query its `window` last keys, transformers'
sliding_window_overlay) gets no mask in a row without padding (windowless_mask): each chunk runs against the keys its
window reaches, one call forward and one backward (BandedAttention). On CUDA that is flash's local attention
(_flash_attention_forward/_backward, window_size_left window - 1 under is_causal, read from the bottom right: mha_fwd),
which skips the blocks outside the band; on CPU the kernel takes the band as a [chunk x keys] additive mask."""

from __future__ import annotations

import torch

from ..errors import RecipeError
from ..planning.attention import chunks_dropout_note, query_chunk_tokens

NAME = "sdpa_query_chunks"  # the model's attn_implementation once applied (no "flash" in it: loss.varlen)


class CudaFlash:
    """torch's flash kernel on CUDA: forward keeps what its backward reads (the logsumexp, the sequence bounds and the
    random state, as aten's autograd formula for it does)."""

    @staticmethod
    def forward(q, k, v, scale):
        out, *kept = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        return out, kept[:7]  # (logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused)

    @staticmethod
    def backward(grad, q, k, v, out, kept, scale, causal):
        lse, cum_q, cum_k, max_q, max_k, rng, unused = kept
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale)

    @staticmethod
    def banded(q, k, v, scale, window):
        """A chunk of queries against the keys its window reaches ([b, h, c, d] views in, flash's [b, c, h, d] out)."""
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            *(x.transpose(1, 2) for x in (q, k, v)), None, None, q.shape[2], k.shape[2], 0.0, True, False,
            scale=scale, window_size_left=window - 1, window_size_right=0)
        return out.transpose(1, 2), [lse, rng, unused]

    @staticmethod
    def banded_backward(grad, q, k, v, out, kept, scale, window):
        lse, rng, unused = kept
        grads = torch.ops.aten._flash_attention_backward(
            *(x.transpose(1, 2) for x in (grad, q, k, v, out)), lse, None, None, q.shape[2], k.shape[2], 0.0, True,
            rng, unused, scale=scale, window_size_left=window - 1, window_size_right=0)
        return tuple(x.transpose(1, 2) for x in grads)


class CpuFlash:
    """torch's CPU flash kernel, whose is_causal reads from the top left: a chunk's forward as two calls, its own keys
    (a square, causal) and the keys before them (wholly visible), merged by their log-sum-exps, so no dense mask is
    made; in backward every block is one of those two, so none is needed there either."""

    @staticmethod
    def forward(q, k, v, scale):
        op, start = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, k.shape[2] - q.shape[2]
        out, lse = op(q, k[:, :, start:], v[:, :, start:], 0.0, True, scale=scale)
        if start:
            before, lse_before = op(q, k[:, :, :start], v[:, :, :start], 0.0, False, scale=scale)
            total = torch.logaddexp(lse, lse_before)
            out = (out.float() * (lse - total).exp().unsqueeze(-1)
                   + before.float() * (lse_before - total).exp().unsqueeze(-1)).to(q.dtype)
            lse = total
        return out, [lse]

    @staticmethod
    def backward(grad, q, k, v, out, kept, scale, causal):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, kept[0], 0.0, causal, scale=scale)

    @staticmethod
    def banded(q, k, v, scale, window):
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = op(q, k, v, 0.0, False, attn_mask=band(q.shape[2], k.shape[2], window, q.dtype), scale=scale)
        return out, [lse]

    @staticmethod
    def banded_backward(grad, q, k, v, out, kept, scale, window):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, kept[0], 0.0, False, attn_mask=band(q.shape[2], k.shape[2], window, q.dtype),
            scale=scale)


def band(queries: int, keys: int, window: int, dtype=torch.bool, device=None) -> torch.Tensor:
    """The mask of `queries` against `keys` read from the bottom right (the last query's key is the last): each query
    sees itself and the `window - 1` keys before it (transformers' sliding_window_overlay, flash's local attention).
    Boolean (True: seen), or additive in `dtype`."""
    row = torch.arange(queries, device=device).unsqueeze(1) + (keys - queries)
    col = torch.arange(keys, device=device)
    seen = (col <= row) & (col > row - window)
    return seen if dtype == torch.bool else torch.full(seen.shape, float("-inf"), dtype=dtype, device=device
                                                       ).masked_fill_(seen, 0.0)


def kernel_for(device: torch.device):
    """The kernel one chunk runs on (tests stand in for CUDA's on CPU: tests/standins.py)."""
    return CudaFlash if device.type == "cuda" else CpuFlash


class QueryChunkedAttention(torch.autograd.Function):
    """Causal attention over q [b, h, L, d] and k, v [b, kv, L, d] (K/V heads as the model has them), `chunk` queries
    a call.

    Forward: each chunk of queries against every key before its end, one call; the outputs written into one
    [b, L, h, d] tensor (the layout sdpa returns, which o_proj reads with no copy), kept for backward with each
    chunk's logsumexp.

    Backward: each chunk of queries against each chunk of keys before it (wholly visible) and its own (square,
    causal), one call of the kernel's backward each. That is exact: the kernel remakes the probabilities from the
    logsumexp it is given (the chunk's, over all its keys) and the row sums of dout x out from the chunk's whole
    output, so a block of keys gets its own share of every gradient. The kernel's buffers over the keys (dK and dV at
    every query head under GQA) hold a chunk, not the sequence. A chunk of queries sums its dq over the key chunks
    in fp32; a chunk of keys sums its dK and dV over the query chunks in fp32 until the last that reads it (itself:
    the query chunks are walked from the last) and is then rounded once."""

    @staticmethod
    def forward(ctx, q, k, v, chunk, scale):
        kernel = kernel_for(q.device)
        b, h, length, d = q.shape
        out = q.new_empty(b, length, h, d).transpose(1, 2)
        bounds, kept = [], []
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            part, rest = kernel.forward(q[:, :, start:end], k[:, :, :end], v[:, :, :end], scale)
            out[:, :, start:end] = part
            del part
            bounds.append((start, end))
            kept.append(rest)
        ctx.save_for_backward(q, k, v, out)
        ctx.kernel, ctx.bounds, ctx.kept, ctx.scale = kernel, bounds, kept, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out = ctx.saved_tensors
        bounds = ctx.bounds
        dq = torch.empty_like(out)
        sums: dict[int, tuple] = {}  # each key chunk's fp32 dK and dV while query chunks read it
        done: dict[int, tuple] = {}  # ... then in k's dtype
        for i in reversed(range(len(bounds))):
            start, end = bounds[i]
            rows = grad[:, :, start:end], q[:, :, start:end]
            dq_i = torch.zeros(rows[1].shape, dtype=torch.float32, device=q.device)
            for j, (first, last) in enumerate(bounds[:i + 1]):
                part_q, part_k, part_v = ctx.kernel.backward(*rows, k[:, :, first:last], v[:, :, first:last],
                                                             out[:, :, start:end], ctx.kept[i], ctx.scale, j == i)
                dq_i += part_q
                if j in sums:
                    sums[j][0].add_(part_k)
                    sums[j][1].add_(part_v)
                else:
                    sums[j] = (part_k.float(), part_v.float())
                del part_q, part_k, part_v
            dq[:, :, start:end] = dq_i
            del dq_i
            done[i] = tuple(part.to(k.dtype) for part in sums.pop(i))  # (no query chunk before i reads key chunk i)
        dk = torch.cat([done[i][0] for i in range(len(bounds))], dim=2)
        dv = torch.cat([done[i][1] for i in range(len(bounds))], dim=2)
        return dq, dk, dv, None, None


class BandedAttention(torch.autograd.Function):
    """Causal sliding-window attention over q [b, h, L, d] and k, v [b, kv, L, d], `chunk` queries a call, each query
    its `window` last keys (itself among them).

    Forward: each chunk of queries against the keys its window reaches (from window - 1 before its first query to its
    end), one call; the outputs written into one [b, L, h, d] tensor, kept with each chunk's logsumexp. Backward: the
    same block, one call of the kernel's backward (the kernel remakes the probabilities from the block's logsumexp,
    over every key the chunk sees, so the block's gradients are whole). The kernel's buffers over the keys hold
    chunk + window - 1 of them. A key is read by the query chunks its window reaches: its chunk of keys sums their dK
    and dV in fp32 until the last that reads it (its own: the query chunks are walked from the last), then rounds
    once."""

    @staticmethod
    def forward(ctx, q, k, v, chunk, scale, window):
        kernel = kernel_for(q.device)
        b, h, length, d = q.shape
        out = q.new_empty(b, length, h, d).transpose(1, 2)
        bounds, kept = [], []
        for start in range(0, length, chunk):
            end, first = min(start + chunk, length), max(0, start - window + 1)
            part, rest = kernel.banded(q[:, :, start:end], k[:, :, first:end], v[:, :, first:end], scale, window)
            out[:, :, start:end] = part
            del part
            bounds.append((first, start, end))
            kept.append(rest)
        ctx.save_for_backward(q, k, v, out)
        ctx.kernel, ctx.bounds, ctx.kept, ctx.scale, ctx.window, ctx.chunk = kernel, bounds, kept, scale, window, chunk
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out = ctx.saved_tensors
        chunk, length = ctx.chunk, q.shape[2]
        dq = torch.empty_like(out)
        sums: dict[int, tuple] = {}  # each key chunk's fp32 dK and dV while query chunks read it
        done: dict[int, tuple] = {}  # ... then in k's dtype
        for i in reversed(range(len(ctx.bounds))):
            first, start, end = ctx.bounds[i]
            part_q, part_k, part_v = ctx.kernel.banded_backward(
                grad[:, :, start:end], q[:, :, start:end], k[:, :, first:end], v[:, :, first:end],
                out[:, :, start:end], ctx.kept[i], ctx.scale, ctx.window)
            dq[:, :, start:end] = part_q
            del part_q
            for j in range(first // chunk, i + 1):  # the key chunks the band reaches
                keys = range(j * chunk, min((j + 1) * chunk, length))
                if j not in sums:
                    sums[j] = tuple(torch.zeros(*k.shape[:2], len(keys), k.shape[3], device=k.device) for _ in "kv")
                lo = max(keys.start, first)
                sums[j][0][:, :, lo - keys.start:].add_(part_k[:, :, lo - first:keys.stop - first])
                sums[j][1][:, :, lo - keys.start:].add_(part_v[:, :, lo - first:keys.stop - first])
            del part_k, part_v
            done[i] = tuple(part.to(k.dtype) for part in sums.pop(i))  # (no query chunk before i reads key chunk i)
        dk = torch.cat([done[i][0] for i in range(len(ctx.bounds))], dim=2)
        dv = torch.cat([done[i][1] for i in range(len(ctx.bounds))], dim=2)
        return dq, dk, dv, None, None, None


def chunked_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function interface (its sdpa_attention_forward's arguments). A row without a mask
    runs in chunks of the module's `query_chunk` queries (where it is longer than one, or where the layer's sliding
    window cuts its keys: BandedAttention); a row with one (packed or padded) runs transformers' sdpa as it is, which
    the plan counts so."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    chunk, length = getattr(module, "query_chunk", 0), query.shape[2]
    window = kwargs.get("sliding_window") or 0
    banded = attention_mask is None and 0 < window < length  # (windowless_mask gave none: the window is the layer's)
    plain = kwargs.get("s_aux") is not None or kwargs.get("softcap")  # (sinks, a softcap: not what the chunks compute)
    if banded and (plain or not chunk or length != key.shape[2]):  # sdpa then, with the window's mask
        attention_mask, banded = band(length, key.shape[2], window, device=query.device)[None, None], False
    if attention_mask is not None or plain or not chunk or length != key.shape[2] or (length <= chunk and not banded):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise RecipeError(chunks_dropout_note(dropout))
    if query.is_cuda and query.dtype not in (torch.float16, torch.bfloat16):
        raise RecipeError(f"query_chunks runs torch's flash kernel, in 16 bits on a GPU; this run's attention computes "
                          f"in {str(query.dtype).removeprefix('torch.')}: set mixed_precision=bf16")
    if banded:
        out = BandedAttention.apply(query, key, value, min(chunk, length), scaling, window)
    else:
        out = QueryChunkedAttention.apply(query, key, value, chunk, scaling)
    return out.transpose(1, 2), None  # [b, L, h, d], as sdpa_attention_forward returns it


def windowless_mask(**kwargs):
    """transformers' mask for sdpa (masking_utils.sdpa_mask, which the masking functions call by keyword), but none
    for a sliding-window layer over rows without padding, as many queries as keys from the first (a training
    forward): chunked_attention takes the window from the layer (its sliding_window argument), where sdpa_mask would
    build the dense [S x S] band."""
    from transformers.masking_utils import sdpa_mask

    padding = kwargs.get("attention_mask")
    if (kwargs.get("local_size") and kwargs.get("allow_is_causal_skip", True)
            and kwargs["q_length"] == kwargs["kv_length"] and not kwargs.get("q_offset") and not kwargs.get("kv_offset")
            and (padding is None or bool(padding.all()))):
        return None
    return sdpa_mask(**kwargs)


def apply(model, recipe, accelerator) -> int:
    """The rung (planning/rungs.py): every attention module's calls through chunked_attention, `query_chunk`
    queries each (planning.attention.query_chunk_tokens); returns that chunk."""
    from transformers import AttentionInterface, AttentionMaskInterface

    config = model.config
    if getattr(config, "attention_dropout", 0.0):
        raise RecipeError(chunks_dropout_note(config.attention_dropout))
    device = getattr(accelerator, "device", None)
    if device is not None and device.type == "cuda":  # (flash_api.cpp's checks, said before the first step)
        capability = torch.cuda.get_device_capability(device)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if capability < (8, 0) or head_dim % 8 or head_dim > 256:
            raise RecipeError(f"query_chunks runs torch's flash kernel, which needs compute capability 8.0 or more "
                              f"and a head dim that is a multiple of 8 up to 256 (this GPU: {capability[0]}."
                              f"{capability[1]}, head dim {head_dim}): set query_chunks=false")
    chunk = query_chunk_tokens(recipe.query_chunks)
    AttentionInterface.register(NAME, chunked_attention)
    AttentionMaskInterface.register(NAME, windowless_mask)  # (sdpa's masks: none for a row of one document)
    ulysses = getattr(recipe, "sequence_parallel", 1) != 1
    if ulysses:  # DeepSpeed's Ulysses wraps the kernel the config names (sdpa) at prepare, reading it from
        # transformers' registry (ulysses_sp.py, register_with_transformers): the chunks stand in for sdpa there, each
        # call a whole sequence for the process's share of the heads (the model keeps the name the wrapper checks);
        # the wrapper drops every mask, and the chunks read a layer's window from its sliding_window argument
        AttentionInterface.register("sdpa", chunked_attention)
        AttentionMaskInterface.register("sdpa", windowless_mask)
    for module in model.modules():
        if getattr(getattr(module, "config", None), "_attn_implementation", None) == "sdpa" and not ulysses:
            module.config._attn_implementation = NAME
        if hasattr(module, "is_causal") and hasattr(module, "head_dim"):  # an attention module
            module.query_chunk = chunk
    return chunk
