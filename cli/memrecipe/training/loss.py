"""The language-model loss, with or without the full logits.

Plain: the model returns [tokens x vocab] logits, upcast to fp32 for the cross-entropy. For a large
vocabulary that is the biggest tensor of the whole step (Llama-3 8B, 2 x 2048 tokens: 4.9 GiB).

Fused (`fused_loss: true`): the output head's forward is replaced, on the live module, by one that
takes the labels, keeps only the positions that predict a target (prompts and padding never reach
the head), and runs head + cross-entropy chunk by chunk (`loss_chunk_tokens`): a plain linear head
through HeadLoss (backward recomputes the logits a tile at a time and sums the head's gradient in fp32),
a wrapped one (LoRA on the head) under non-reentrant checkpointing. Nothing of [tokens x vocab] is ever
held whole.

The head is still called as a module from inside the model's own forward, so every engine's hooks
see it: DDP's, FSDP2's unshard of the root's parameters, DeepSpeed ZeRO-3's gather (a LoRA-wrapped
head is made a ZeRO-3 leaf, so its weights are gathered once, as for any module the engine hooks).
The model then returns one fp32 loss per target token where it would return logits.
"""

from __future__ import annotations

from functools import partial
from typing import Literal, overload

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ..planning.recipe import LOSS_CHUNK_TOKENS
from .data import IGNORE

# Configs whose CausalLM forward transforms the head's output before the loss: the fused head would
# skip that transform, so those models keep the plain loss.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def token_loss(logits: torch.Tensor, labels: torch.Tensor, per_sequence: bool = False) -> torch.Tensor:
    """Next-token cross-entropy summed over target tokens (labels != -100), in fp32: one number,
    or one per sequence."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)  # shift the labels, not the logits: no copy of those
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none")
    return losses.view(labels.shape[0], -1).sum(-1) if per_sequence else losses.sum()


def next_tokens(batch: dict) -> torch.Tensor:
    """Each position's target ([B, S]; IGNORE where there is none): the labels shifted one to the left, or a slice's
    `shift_labels` under Ulysses (shifted before the sequence was cut, so a slice's last token keeps its target, the
    first token of the next slice)."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE)


@overload
def count_targets(batch: dict, per_sequence: Literal[False] = False) -> int: ...
@overload
def count_targets(batch: dict, per_sequence: Literal[True]) -> torch.Tensor: ...
def count_targets(batch: dict, per_sequence: bool = False) -> int | torch.Tensor:
    """A batch's target tokens (those the loss counts): one int, or a tensor with one count per sequence."""
    mask = next_tokens(batch) != IGNORE
    return mask.sum(-1) if per_sequence else int(mask.sum())


def fused_blocker(config) -> str | None:
    """Why the fused loss cannot serve this model (None: it can). A multimodal config keeps its language model's
    keys in its text part (get_text_config), where the logit softcapping of e.g. Gemma 3 sits."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for part in (config, text) if text is not config else (config,):
        for key in LOGIT_TRANSFORMS:
            if getattr(part, key, None) not in (None, 1, 1.0):
                return f"{config.model_type} transforms its logits ({key}) before the loss"
    return None


def unwrapped(model):
    """The model inside DDP / DeepSpeed engine wrappers (they keep it as .module)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def output_head(model):
    """The module that maps hidden states to logits, through DDP / DeepSpeed / PEFT wrappers."""
    return unwrapped(model).get_output_embeddings()


def fuse_head(model, chunk_tokens: int = LOSS_CHUNK_TOKENS) -> str | None:
    """Give the model's output head the fused loss, `chunk_tokens` target tokens per chunk (call after LoRA, before
    accelerate's prepare). Returns why not, or None once fused."""
    blocker = fused_blocker(model.config)
    head = output_head(model)
    if blocker is None and head is None:
        blocker = "the model has no output head"
    if blocker is not None:
        return blocker
    fused = hasattr(head, "memrecipe_targets")
    head.memrecipe_tokens = chunk_tokens
    if fused:  # fused already (the loop's setup): a second wrap would feed the chunks to the fused forward
        return None
    original = head.forward
    plain = type(head) is torch.nn.Linear  # its own weights: the chunks' loss is computed here, by HeadLoss

    def forward(hidden, *args, **kwargs):
        targets = head.memrecipe_targets  # each position's next token (next_tokens)
        if targets is None:  # plain logits: generation, or a caller that did not give labels
            return original(hidden, *args, **kwargs)
        keep = targets != IGNORE
        inputs, targets = hidden[keep], targets[keep]  # only positions that predict a target
        tokens = head.memrecipe_tokens
        if plain:
            return HeadLoss.apply(inputs, targets, tokens, head.weight, head.bias)
        # a wrapped head (LoRA, quantized): its own forward, chunk by chunk under checkpointing. split, not sliced:
        # backward then joins the chunks' gradients once (a slice's backward writes a zero-padded full-size
        # gradient per chunk). At least one chunk, even empty: the head's weights must be in the graph whatever
        # the batch (DDP expects every parameter to get a gradient).
        return torch.cat([checkpoint(_chunk_loss, original, h, y, use_reentrant=False)
                          for h, y in zip(inputs.split(tokens), targets.split(tokens))])

    head.forward, head.memrecipe_targets = forward, None
    if any(True for _ in head.children()):  # e.g. a LoRA-wrapped head: ZeRO-3 gathers all of it at once
        head._z3_leaf = True
    return None


def _chunk_loss(forward, hidden, targets):
    return F.cross_entropy(_chunk_logits(forward, hidden), targets, reduction="none")


def _chunk_logits(forward, hidden):
    """One chunk's (or, in HeadLoss's backward, one tile's) fp32 logits: every path computes them here, in forward
    and again in backward."""
    return forward(hidden).float()


def tile_rows(tokens: int, targets: int, vocab: int, width: int, trained: bool, cuda: bool) -> int:
    """The vocabulary rows HeadLoss's backward takes at a time (`tokens` a chunk, `targets` in all). A trained head's:
    its block's fp32 gradient sum a quarter of a chunk's fp32 logits. A frozen head (LoRA, QLoRA) has no sum to bound,
    and on a GPU takes the whole vocabulary, one tile a chunk, where the tile (its fp32 logits and their 16-bit
    gradient, 6 bytes a logit) beside the input's fp32 gradient (4 bytes x width a target) stays within the forward's
    chunk (8 bytes a logit, planned: planning.activations.loss_bytes), so it costs no memory the plan does not hold:
    16x fewer tiles for a 128K vocabulary at 512-token chunks, each tile ~28 ops, each a kernel launch (host time in a
    launch-bound step). At long context, where the input's gradient outgrows a chunk's logits, the blocks stay; so
    they do on a CPU, whose caches hold a block's tile and not a whole chunk's (measured: a LoRA step with a 32K
    vocabulary 1.10x slower with whole tiles)."""
    if cuda and not trained and 2 * targets * width <= min(tokens, targets) * vocab:
        return vocab
    return max(1, tokens * vocab // (4 * width))


class HeadLoss(torch.autograd.Function):
    """One loss per target token through a plain linear head, chunk by chunk, holding neither the logits nor a copy of
    the head's gradient. Forward keeps the inputs and each token's log-sum-exp (4 bytes). Backward walks the head in
    blocks of vocabulary rows and, for each block, every chunk: it recomputes that tile of logits, turns it into the
    loss's gradient (softmax from the saved log-sum-exp, minus the target's one-hot) and adds the tile's products to
    the input's gradient and to the block's weight gradient, summed in fp32 and written out once per block. So the
    head's gradient is summed in fp32 whatever the weights' dtype (autograd would sum the chunks' gradients in bf16
    under bf16 weights, rounding the small additions away: tests/unit/training/test_loss.py) without an fp32 copy of the whole
    head, and each block is read once per chunk, as the chunked forward reads it.

    The matmuls run in the autocast dtype when autocast is on (the weight cast once per pass, as F.linear's autocast
    would), else in the weight's. Called from the head module's own forward, so every engine's hooks (DDP, FSDP2's
    unshard, ZeRO-3's gather) see the head as before."""

    @staticmethod
    def forward(ctx, hidden, targets, tokens, weight, bias):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        with torch.autocast(device, enabled=False):
            head = partial(F.linear, weight=weight.to(dtype), bias=None if bias is None else bias.to(dtype))
            losses, lse = [], []
            for h, y in zip(hidden.split(tokens), targets.split(tokens)):
                logits = _chunk_logits(head, h.to(dtype))
                lse.append(torch.logsumexp(logits, dim=-1))
                losses.append(lse[-1] - logits.gather(1, y[:, None]).squeeze(1))
                del logits
        lse = torch.cat(lse) if lse else hidden.new_zeros(0, dtype=torch.float32)
        ctx.save_for_backward(hidden, targets, weight, bias, lse)
        ctx.tokens, ctx.dtype = tokens, dtype
        return torch.cat(losses) if losses else lse.clone()

    @staticmethod
    def backward(ctx, grad):
        hidden, targets, weight, bias, lse = ctx.saved_tensors
        dtype, tokens = ctx.dtype, ctx.tokens
        wants_hidden, _, _, wants_weight, wants_bias = ctx.needs_input_grad
        vocab, width = weight.shape
        rows = tile_rows(tokens, len(targets), vocab, width, trained=wants_weight, cuda=hidden.is_cuda)
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if wants_hidden else None
        grad_weight = torch.empty_like(weight) if wants_weight else None
        grad_bias = torch.empty_like(bias) if wants_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            inputs = hidden.to(dtype)
            for first in range(0, vocab, rows):
                last = min(first + rows, vocab)
                w = weight[first:last].to(dtype)
                b = None if bias is None else bias[first:last].to(dtype)
                block = torch.zeros(last - first, width, dtype=torch.float32, device=weight.device) if wants_weight else None
                block_bias = torch.zeros(last - first, dtype=torch.float32, device=weight.device) if wants_bias else None
                for start in range(0, len(targets), tokens):
                    end = start + tokens
                    h, y = inputs[start:end], targets[start:end]
                    d = _chunk_logits(partial(F.linear, weight=w, bias=b), h)  # this tile of logits, in fp32
                    d = d.sub_(lse[start:end, None]).exp_()  # softmax
                    # minus 1 at each target this block holds, with no host read (a boolean index or nonzero would
                    # wait for the GPU twice a tile): the others add 0 at a clamped column
                    inside = ((y >= first) & (y < last)).to(d.dtype)
                    d.scatter_add_(1, (y - first).clamp(0, last - first - 1)[:, None], -inside[:, None])
                    d = d.mul_(grad[start:end, None]).to(dtype)  # d loss / d logits
                    if wants_hidden:
                        grad_hidden[start:end] += d @ w
                    if wants_weight:
                        block += d.t() @ h
                    if wants_bias:
                        block_bias += d.float().sum(0)  # pyright: ignore[reportOperatorIssue]  (wants_bias: made)
                    del d  # before the next tile's logits
                if wants_weight:
                    grad_weight[first:last] = block  # pyright: ignore[reportArgumentType]  (wants_weight: made)
                if wants_bias:
                    grad_bias[first:last] = block_bias  # pyright: ignore[reportArgumentType]  (wants_bias: made)
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype), None, None, grad_weight, grad_bias)


# Attention implementations that read a packed row's documents from position_ids as variable-length sequences,
# and only in a batch of ONE row: transformers' flash path (modeling_flash_attention_utils._is_packed_sequence:
# `batch_size != 1 -> False`) would otherwise run plain causal attention over each [B, S] row, across documents.
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")


def varlen(model) -> bool:
    """Whether the model's attention runs packed rows as variable-length sequences (then a packed micro batch is
    called as one flattened row)."""
    implementation = getattr(unwrapped(model).config, "_attn_implementation", None) or ""
    return implementation in VARLEN_ATTENTION or "flash" in implementation  # (hub kernels: .../flash-attn...)


# A ring attention slice's mark (training.ring): its positions jump where its two chunks meet, which transformers
# would read as packed documents (masking_utils.find_packed_sequence_indices, when no attention_mask is given) and
# mask with a materialized [S x S] tensor per row; an all-ones mask says the rows are whole, so sdpa runs causal with
# no mask tensor (accelerate's hooks drop masks anyway; the ring kernels run causal).
RING_SLICE = "memrecipe_ring_slice"


def model_inputs(batch: dict, flatten: bool = False) -> dict:
    """What the model is called with. A packed batch (with position_ids) goes without attention_mask and
    without a KV cache: transformers then reads the document boundaries from the positions restarting at 0,
    so no token attends across documents. With an attention_mask, or a cache, it would not (measured: a second
    document's logits differ by ~0.5). sdpa and eager build a block-diagonal causal mask over each [B, S] row
    (masking_utils); the varlen flash kernels see the documents only in one row, so with `flatten` (see `varlen`)
    the micro batch is called as [1, B x S]: its rows end in padding (a document of its own) and start with a
    document, whose first token is no target, so the targets and their order are unchanged. sdpa and eager keep
    [B, S]: one flattened row would build a (B x S)^2 mask."""
    if "position_ids" in batch:
        ids, positions = batch["input_ids"], batch["position_ids"]
        if flatten:
            ids, positions = ids.reshape(1, -1), positions.reshape(1, -1)
            return {"input_ids": ids, "position_ids": positions, "use_cache": False, **varlen_kwargs(positions)}
        inputs = {"input_ids": ids, "position_ids": positions, "use_cache": False}
        if batch.get(RING_SLICE):  # whole rows, cut by ring attention: see RING_SLICE
            inputs["attention_mask"] = torch.ones_like(ids)
        return inputs
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def varlen_kwargs(positions: torch.Tensor) -> dict:
    """flash-attn's variable-length arguments for a flattened packed row, worked out once a micro batch
    (transformers' prepare_fa_kwargs_from_position_ids, as DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    passes them): given them, each layer's _flash_attention_forward skips _is_packed_sequence and its own
    prepare_fa_kwargs_from_position_ids, which read the positions back to the host 2-3 times a layer (and break a
    compiled graph). One host read here, for the longest document."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    (cu_q, cu_k), (longest_q, longest_k) = prepare_fa_kwargs_from_position_ids(positions)
    return {"cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_k, "max_length_q": int(longest_q), "max_length_k": int(longest_k)}


def target_losses(model, batch) -> torch.Tensor:
    """Each target token's next-token cross-entropy (-log p), in fp32, in the row-major order of the target mask
    (next_tokens != IGNORE): through the fused head when the model has one, else from the full logits."""
    head, targets = output_head(model), next_tokens(batch)  # (shift the labels, not the logits: no copy of those)
    inputs = model_inputs(batch, flatten=varlen(model))
    if not hasattr(head, "memrecipe_targets"):
        logits = model(**inputs).logits.view(*targets.shape, -1)  # (a flattened row back to its rows)
        losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none")
        return losses[targets.flatten() != IGNORE]
    head.memrecipe_targets = targets.reshape(inputs["input_ids"].shape)  # the targets of the row(s) it is called on
    try:  # the head returns one loss per target token, in the order of the target mask
        return model(**inputs).logits
    finally:
        head.memrecipe_targets = None


def per_group(losses: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor, count: int) -> torch.Tensor:
    """target_losses summed per group: `groups` [B, S] numbers each position's group (a row, a packed document),
    read at each target; `count` groups."""
    at = groups[:, 1:][labels[:, 1:] != IGNORE]  # (flattened: the same targets, in the same row-major order)
    return losses.new_zeros(count).index_add_(0, at, losses)


def lm_loss(model, batch, per_sequence: bool = False) -> torch.Tensor:
    """The batch's next-token cross-entropy, summed over its target tokens (or per sequence), in fp32."""
    losses = target_losses(model, batch)
    if not per_sequence:
        return losses.sum()
    targets = next_tokens(batch)
    rows = torch.arange(targets.shape[0], device=targets.device)[:, None].expand_as(targets)[targets != IGNORE]
    return losses.new_zeros(targets.shape[0]).index_add_(0, rows, losses)
