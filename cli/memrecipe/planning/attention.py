"""Which attention kernel a run uses (`attn_implementation: auto`), decided from facts about the machine, without
torch: the planner plans what a launch will run, and the launch (training.loading) says which it took and why.

What each one does with packed rows (several documents per row, position_ids restarting at 0), read in
transformers 5.23 and torch 2.13:
- flash_attention_2: the micro batch called as one flattened row (training.loss.model_inputs), each document a
  variable-length sequence (flash_attn_varlen_func): no mask, no work across documents, grouped K/V heads as they are.
- flex_attention: a BlockMask of the causal and document masks (masking_utils.flex_attention_mask): blocks where
  no token may attend are skipped, K/V heads are shared (enable_gqa). Its kernel is compiled on first use (Triton on
  CUDA); torch 2.13 has no flex backward on CPU (flex_attention._validate_device), and transformers' flex path
  refuses attention dropout (integrations/flex_attention.py).
- sdpa: a dense [B, 1, S, S] mask (masking_utils.sdpa_mask: packed rows turn off the is_causal shortcut). With a
  mask, sdpa_attention_forward copies K/V to every query head (use_gqa_in_sdpa: CUDA needs no mask for GQA), and
  torch converts the boolean mask to an additive one in the compute dtype, both saved for backward in every layer;
  every S x S block is computed, across documents and above the diagonal. So too in a sliding-window layer
  (Mistral's, Gemma 2's and 3's every other or five of six, Phi-3's) once a row reaches its window: transformers
  gives sdpa the is_causal shortcut only below it (masking_utils._ignore_causal_mask_sdpa: a mask from
  kv_length >= window), and on CUDA the mask keeps the row from flash's kernel, which takes none: the kernel that
  takes it (memory-efficient attention) adds it to every block of the square. flash_attention_2 passes the window
  to flash-attn's kernel (window_size), flex_attention folds it into its BlockMask: neither builds a mask, and both
  skip the blocks outside the window.
"""

from __future__ import annotations

from typing import NamedTuple

CHOICES = ("auto", "sdpa", "eager", "flash_attention_2", "flex_attention")


class Attention(NamedTuple):
    name: str  # what transformers runs (its attn_implementation)
    why: str  # one line: why this one


def offset_limit(heads: int, head_dim: int) -> int:
    """The most tokens one call may hold (a micro batch: flash-attn's varlen rows flattened, or sdpa's rows one after
    another) for flash-attn 2's backward to address right, in every release to 2.8.3.post1 and in torch's own copy of
    its kernel, which sdpa runs on CUDA: the fp32 dq accumulator's offset, a token's index x heads x the head dim
    rounded up (to 32; to 64 past 128), is computed in 32-bit int (flash_bwd_kernel.h, row_offset_dq_accum: int
    factors, and block_info.h's q_offset deduced as int from them; upstream's fix, flash-attn #2260, is not released)
    and past 2^31 it wraps: writes out of bounds, not an error. 524,288 tokens at 32 heads x 128. flex_attention's
    Triton kernels switch to 64-bit indexing (inductor's select_algorithm)."""
    step = 32 if head_dim <= 128 else 64
    return 2**31 // (heads * (-(-head_dim // step) * step))


QUERY_CHUNK = 16 * 1024  # query_chunks: true's queries a call (a chunk's backward holds 24 KB a query at 32 x 128)


def query_chunk_tokens(query_chunks: bool | int) -> int:
    """Queries per call of sdpa's kernel under query_chunks (training.query_chunks); 0: the whole row."""
    if query_chunks is False:
        return 0
    return QUERY_CHUNK if query_chunks is True else query_chunks


def chunked(query_chunks: bool | int, name: str, packing: bool, micro_batch: int, seq: int, window: int = 0) -> int:
    """The queries one call of the kernel holds in a plan under query_chunks, where a row of `seq` runs in chunks
    (sdpa without a mask, longer than one chunk, or in a layer whose sliding `window` the row passes: then at most
    the row, one call, training.query_chunks.BandedAttention); 0 where it runs whole."""
    chunk = query_chunk_tokens(query_chunks)
    if not chunk or name != "sdpa" or dense_mask(name, packing, micro_batch):
        return 0
    return chunk if seq > chunk else seq if 0 < window < seq else 0


def mask_window(query_chunks: bool | int, window: int) -> int:
    """The sliding window that gives sdpa a dense mask past it (dense_mask): none under query_chunks, whose mask
    function gives a windowed layer's rows without padding none (training.query_chunks.windowless_mask), its
    chunks taking the window from the layer."""
    return 0 if query_chunks is not False else window


CPU_KEY_BLOCK = 512  # keys a block of torch's CPU flash kernel (or all of them, fewer)


def cpu_query_block(queries: int) -> int:
    """Queries a block of torch's CPU flash kernel, forward and backward, by the call's query count
    (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp: qSplitSize 256 from 768 queries, 64 from 192, else 32;
    kvSplitSize CPU_KEY_BLOCK). The planner's CPU bytes (each thread's blocks of scores) and CPU time (the blocks a
    causal row computes whole) both follow it."""
    return 256 if queries >= 768 else 64 if queries >= 192 else 32


def offsets_note(name: str, tokens: int, heads: int, head_dim: int) -> str | None:
    """One line when `tokens` in one call of `name` on CUDA pass offset_limit (`heads`: those one process attends
    to): the run is refused, naming the kernel that is safe."""
    limit = offset_limit(heads, head_dim)
    if name not in ("flash_attention_2", "sdpa") or tokens <= limit:
        return None
    return (f"attention: {name}'s backward addresses its dq accumulator with 32-bit offsets, which wrap past "
            f"{limit:,} tokens a micro batch at {heads} heads x {head_dim} (flash-attn <= 2.8.3.post1, and torch's "
            f"copy of its kernel under sdpa): {tokens:,} would write out of bounds: use "
            "attn_implementation=flex_attention (64-bit offsets) or fewer tokens a micro batch")


def pick_attention(requested: str, *, cuda: bool, half: bool, packing: bool, flash: bool, flex: bool,
                   flash_error: str | None = None, sequence_parallel: bool = False, ring: bool = False,
                   past_offsets: bool = False, windowed: bool = False, sdpa: bool = True) -> Attention:
    """`auto`: flash-attn's varlen kernel where it can run (CUDA, 16-bit compute, installed and importing), else
    flex_attention's block-sparse mask for packed rows on CUDA, or rows reaching a sliding window (`windowed`:
    Structure.masked_windows), where sdpa would take a dense mask, else sdpa; flex_attention past the 32-bit offsets
    of flash's and sdpa's backward (`past_offsets`: offset_limit); flex_attention on CUDA, else eager, for a model
    whose transformers class has no sdpa path (`sdpa`: Gemma 2). Any other choice is taken as asked (unsupported_note
    refuses one the model has no path for). `flash_error`: why an installed flash-attn does not import. Under
    sequence parallelism `auto` is sdpa: the launch config names the kernel Ulysses wraps (configs.sp_attention)
    before any machine is seen; under ring attention too: torch's context_parallel replaces SDPA's kernels only."""
    if requested != "auto":
        return Attention(requested, "as the recipe asks")
    if ring:
        return Attention("sdpa", "auto under ring attention: torch's context_parallel replaces SDPA's CUDA kernels")
    if sequence_parallel:
        return Attention("sdpa", "auto under sequence parallelism: the kernel the launch config names for Ulysses "
                                 "(flash_attention_2 only where the recipe names it)")
    if cuda and half and flex and past_offsets:
        return Attention("flex_attention", "auto: past the 32-bit offsets of flash-attn's and sdpa's backward "
                                           "(planning.attention.offset_limit), flex_attention indexes in 64 bits")
    if cuda and half and flash:
        return Attention("flash_attention_2", "auto: flash-attn is installed; packed documents run as varlen sequences")
    why = "flash-attn needs CUDA and 16-bit compute" if not (cuda and half) else (
        f"flash-attn is installed but does not import ({flash_error})" if flash_error else "flash-attn is not installed")
    if cuda and packing and flex:
        return Attention("flex_attention", f"auto: {why}; flex_attention skips the blocks across packed documents "
                                           "and above the diagonal (compiled on first use)")
    if cuda and windowed and flex:
        return Attention("flex_attention", f"auto: {why}; the rows reach the model's sliding window, where sdpa "
                                           "takes a dense mask and flex_attention skips the blocks outside the window "
                                           "(compiled on first use)")
    if not sdpa:
        return Attention("flex_attention" if cuda and flex else "eager",
                         f"auto: {why}; this model's transformers class has no sdpa path")
    if not cuda:
        return Attention("sdpa", "auto: on CPU, where flex_attention has no backward and flash-attn does not run")
    return Attention("sdpa", f"auto: {why}" + ("" if packing else "; rows are not packed"))


def unsupported_note(name: str, sdpa: bool, flex: bool, model_type: str) -> str | None:
    """One line when the kernel a run takes is one this model's transformers class has no path for (its
    _supports_sdpa, _supports_flex_attn: Gemma 2 has no sdpa path, GPT-2 no flex one), naming those it has."""
    if name not in ("sdpa", "flex_attention") or {"sdpa": sdpa, "flex_attention": flex}[name]:
        return None
    kernels = ", ".join(k for k, ok in (("flash_attention_2", True), ("flex_attention", flex), ("sdpa", sdpa),
                                        ("eager", True)) if ok)
    return (f"attention: transformers has no {name} path for {model_type} (its class refuses it at load): use "
            f"attn_implementation={kernels.replace(', ', ' or ')}")


def chunks_dropout_note(dropout: float) -> str:
    """The line refusing query_chunks for a model with attention dropout (the chunks run flash's kernel without it)."""
    return (f"query_chunks runs attention without dropout; this model's attention_dropout is {dropout}: "
            "set query_chunks=false")


def dropped_window_note(name: str, sp: int, windows: tuple[int, ...], model_type: str,
                        query_chunks: bool | int = False) -> str | None:
    """One line when Ulysses would run a sliding-window layer as full causal attention (`windows`: those the rows
    reach, Structure.masked_windows): DeepSpeed's UlyssesSPAttentionHF drops every tensor mask (uattn_wrapper), and
    transformers' sdpa_attention_forward reads the window only from the mask, while flash-attn's and the query chunks
    (`query_chunks`: none refused under them) take it from the layer (its sliding_window argument, which the wrapper
    passes on). A wrong result, not an error: refused."""
    if sp == 1 or name != "sdpa" or not any(mask_window(query_chunks, w) for w in windows):
        return None
    return (f"attention: Ulysses drops the attention mask, and under sdpa {model_type}'s sliding-window layers would "
            f"attend to every key before them, not the last {min(windows):,}: use query_chunks=true or (CUDA) "
            f"attn_implementation=flash_attention_2, both taking the window from the layer, or max_seq_length below "
            f"{min(windows):,}")


def ring_window_note(cp: int, windows: tuple[int, ...], model_type: str) -> str | None:
    """One line when ring attention meets a model with sliding-window layers (`windows`: every layer's, 0: full):
    accelerate's context-parallel hooks drop each attention's mask and run it causal, so they refuse such a model at
    prepare (big_modeling._attach_context_parallel_hooks), whatever the rows' length; refused before launch too."""
    if cp == 1 or not any(windows):
        return None
    return (f"attention: ring attention (parallelism.cp_size) runs every layer full causal, and {model_type} has "
            f"sliding-window layers (window {min(w for w in windows if w):,}; accelerate refuses them at prepare): use "
            "zero3-ulysses with attn_implementation=flash_attention_2, or parallelism.cp_size=1")


def dense_mask(name: str, packing: bool, micro_batch: int, seq: int = 0, window: int = 0) -> bool:
    """Whether sdpa gets a dense mask: packed rows, padded rows (more than one per micro batch, padded to the
    longest), or rows of `seq` tokens reaching a layer's sliding `window`. Without one it runs causal with K/V heads
    grouped."""
    return name == "sdpa" and (packing or micro_batch > 1 or 0 < window <= seq)


SQUARE_LIMIT = 2**30  # bytes of [S x S] tensors per layer past which a plan names the kernels that keep none


def square_bytes(name: str, packing: bool, micro_batch: int, seq: int, heads: int, fp32: bool, window: int = 0) -> int:
    """What one layer keeps in [S x S] tensors for backward: eager's scores (the fp32 softmax and, in 16-bit compute,
    its 16-bit copy, per head), or sdpa's dense mask made additive in the compute dtype (measured on CPU:
    tests/unit/planning/test_activations.py). flash_attention_2 and flex_attention keep none. `window`: the
    layer's sliding window (0: none)."""
    if name == "eager":
        return micro_batch * heads * seq * seq * (4 if fp32 else 6)
    if dense_mask(name, packing, micro_batch, seq, window):
        return micro_batch * seq * seq * (4 if fp32 else 2)
    return 0


def kept_mask_bytes(name: str, packing: bool, micro_batch: int, seq: int, checkpoints: bool,
                    windows: tuple[int, ...] = (0,)) -> int:
    """sdpa's boolean masks ([b, 1, S, S], 1 byte an element: transformers' masking_utils.sdpa_mask, once a forward
    for each kind of layer, `windows` (0: full attention), that needs one: rows of several documents or padded ones,
    or a sliding window the rows reach), held to the end of backward under checkpointing: each layer's checkpoint
    keeps its arguments, the mask among them, for its recompute (without checkpointing it is gone by the loss). Each
    layer's sdpa call makes its own additive copy (square_bytes). Measured on CPU: 1.0 and 4.0 MiB of a packed row's
    step peak at 1,024 and 2,048 tokens (tests/unit/planning/test_activations.py). A packed row of one document
    builds none (transformers reads one document from the positions and runs causal), nor the additive copy, which
    the plan still counts there: `packing=false` plans such rows."""
    if not checkpoints:
        return 0
    return micro_batch * seq * seq * sum(dense_mask(name, packing, micro_batch, seq, w) for w in set(windows))


def block_mask_bytes(name: str, micro_batch: int, seq: int, block: int = 128) -> int:
    """flex_attention's BlockMask, made once a forward (transformers' masking_utils.flex_attention_mask:
    create_block_mask) and held by every layer's kernel to the end of backward: per row, the blocks each query block
    reads and each key block is read by, partly and fully masked (kv_indices, full_kv_indices and their transposes
    q_indices, full_q_indices: int32 [blocks x blocks], with their int32 counts; torch/nn/attention/flex_attention.py,
    BlockMask.from_kv_blocks, 128-token blocks). 0.3 GiB at 565K tokens."""
    if name != "flex_attention":
        return 0
    blocks = -(-seq // block)
    return micro_batch * 4 * 4 * blocks * (blocks + 1)


def square_note(name: str, square: int, seq: int) -> str | None:
    """One line when a layer's [S x S] tensors pass SQUARE_LIMIT: which kernels this length needs."""
    if square <= SQUARE_LIMIT:
        return None
    what = "scores" if name == "eager" else "dense mask (packed or padded rows, or past a sliding window)"
    return (f"attention: {name} keeps {square / 2**30:.1f} GiB per layer in its [{seq} x {seq}] {what}: at this "
            "length use attn_implementation=flash_attention_2 (CUDA, flash-attn installed) or flex_attention (CUDA), "
            "which keep none (auto picks one on a GPU)")
