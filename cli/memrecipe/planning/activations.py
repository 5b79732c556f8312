"""Activations per process: what each layer saves for backward (by the way PyTorch saves tensors in transformers'
Llama-family layers, measured on CPU), at each checkpointing mode, and the loss's logits (docs/memory.md)."""

from __future__ import annotations

from .architecture import NORM_AFTER_MLP, SANDWICH_NORMED, Structure, lora_tensors_on_meta
from .attention import (CPU_KEY_BLOCK, block_mask_bytes, chunked, chunks_dropout_note, cpu_query_block,
                        dropped_window_note, kept_mask_bytes, mask_window, offset_limit, offsets_note, pick_attention,
                        ring_window_note, square_bytes, unsupported_note)
from .hardware import usable_cores
from .recipe import Recipe


def activation_mode(recipe: Recipe, compute_bytes: int) -> str:
    """How the weights meet the compute dtype: fp32 | mixed (autocast over fp32 weights) | half | lora | qlora."""
    if compute_bytes == 4 and recipe.weight_dtype == "fp32":
        return "fp32"
    if recipe.quantization is not None and recipe.quantization.upcast_unquantized:
        return "qlora"  # 4-bit linears; PEFT's k-bit preparation puts embeddings, norms and head in fp32
    if recipe.lora is not None:
        return "lora"  # frozen base stored in half precision (see loading.load_pretrained)
    if recipe.fsdp is not None or recipe.deepspeed is not None or recipe.weight_dtype == "bf16":
        return "half"  # FSDP casts gathered params, DeepSpeed keeps the module in half precision
    return "mixed"


def dropout_bytes(cuda: bool, element: int = 4) -> int:
    """Bytes per element a training-mode dropout keeps for backward. On CUDA torch runs the fused kernel,
    native_dropout, which keeps a bool mask (ATen's Dropout.cpp, is_fused_kernel_acceptable: CUDA/XPU inputs only;
    derivatives.yaml: native_dropout's backward reads result1, the mask); on CPU it multiplies by a noise tensor
    of the input's dtype (`element` bytes): fp32 for peft's adapters, which cast their input to the adapter's dtype
    first (16 bits under DeepSpeed's engine: training.adapters.add_lora). Both measured on CPU
    (tests/unit/planning/test_activations.py calls native_dropout there)."""
    return 1 if cuda else element


def residual_bytes(mode: str) -> int:
    """Bytes an element of the residual stream (the layers' inputs, the hidden states) takes: 16 bits over a 16-bit
    base, fp32 where the norms and embeddings stay fp32 (fp32, autocast over fp32 weights, QLoRA's upcast)."""
    return 2 if mode in ("half", "lora") else 4


def compute_bytes(mode: str) -> int:
    """Bytes an element of the layers' matmuls and attention takes: fp32 without autocast, else 16 bits."""
    return 4 if mode == "fp32" else 2


SIBLINGS = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"})  # linears that read one tensor
ATTENTION_INPUT = SIBLINGS[0] | {"qkv_proj", "c_attn", "query_key_value"}  # those reading the first norm's output
KEEPS_ITS_OUTPUT = ("sdpa", "flash_attention_2", "flex_attention")  # kernels whose saved output o_proj reads


def input_of(name: str) -> frozenset[str]:
    """The linears that read the tensor linear `name` reads (its SIBLINGS group, or itself alone)."""
    return next((frozenset(group) for group in SIBLINGS if name in group), frozenset({name}))


def half_adapters(recipe: Recipe, mode: str) -> bool:
    """LoRA's adapters in the 16 bits the layers compute in (DeepSpeed's engine: training.adapters.add_lora), where
    everywhere else they are fp32 and peft casts each input to fp32 before their dropout and A."""
    return recipe.deepspeed is not None and mode == "lora"


def adapter_bytes(linears, recipe: Recipe, mode: str, cuda: bool, attention: str = "sdpa") -> int:
    """Per token, what a layer's adapters on `linears` keep for backward: each its rank-r output, and its input. Under
    autocast (training.adapters.share_inputs) the adapters read their input as it comes and redraw their dropout in
    backward (recompute_dropout): over a 16-bit residual stream those reading one tensor (SIBLINGS) keep it once, and
    o_proj reads what sdpa, flash attention and flex_attention keep of their own output (their [tokens x heads x
    head_dim] layout: transformers' transpose and reshape copy nothing; eager's copy). Compiled flex_attention writes
    its output in the query's stride order (torch/_inductor/kernel/flex/flex_attention.py:
    infer_dense_strides(out_size, q_strides)), and the query after RoPE is [tokens x heads x head_dim] in memory, as
    q_proj wrote it. Compiled layers, and `lora.redraw_dropout: false`, keep peft's dropout: each adapter its 16-bit
    copy of the dropped input and the mask. Measured on CPU:
    tests/unit/planning/test_activations.py."""
    kept_dropout = recipe.keeps_dropout
    mask = dropout_bytes(cuda, 2 if half_adapters(recipe, mode) else 4) if kept_dropout else 0
    element = compute_bytes(mode)  # (in fp32 no cast: without dropout the adapters read the input itself)
    shared = not kept_dropout and mode in ("lora", "fp32")
    kept, read = 0, {input_of("o_proj")} if attention in KEEPS_ITS_OUTPUT else set()
    for lin in linears:
        tensor = input_of(lin.name)
        if not (shared and tensor in read):
            kept += (element + mask) * lin.in_features
        read.add(tensor)
    return kept + element * recipe.lora.r * len(linears)


def tile_count(tiles: bool | int, tokens: int, hidden: int) -> int:
    """`tiled_mlp: true`: tiles of about `hidden` tokens (ALST's choice: a tile's [tokens x intermediate] tensors are
    then the size of one of the MLP's weights); a number: that many (training.tiling runs it)."""
    return max(1, -(-tokens // hidden)) if tiles is True else int(tiles)


def tile_tokens(tiles: bool | int, tokens: int, hidden: int) -> int:
    """The tokens of the largest tile (training.tiling chunks the rows: ceil(tokens / tile_count) each, the last fewer)."""
    return -(-tokens // tile_count(tiles, tokens, hidden))


def norm_rows(width: int, hidden: int) -> int:
    """How many rows of `width` a lean norm (training.norms) works on at a time: a tile of hidden x hidden elements,
    `hidden` tokens of the residual stream (tiled_mlp's tile), as many rows of a narrower norm (per head)."""
    return max(1, hidden * hidden // width)


def mlp_bytes(recipe: Recipe, s: Structure, mode: str, cuda: bool) -> int:
    """Per token, what one layer's dense MLP keeps for backward beside its input: what tiled_mlp frees (measured on
    CPU at the forward's end, tests/unit/planning/test_activations.py: 16i bytes in fp32 and under autocast over
    fp32 weights, 8i with 16-bit weights; under LoRA the frozen linears keep no inputs, the adapters theirs)."""
    if s.experts:
        return 0
    intermediates = (4 if s.gated_mlp else 2) * s.intermediate  # gate, activation, up, product (plain: 2)
    if mode == "fp32" and recipe.lora is not None:
        return 4 * intermediates - frozen_fp32_bytes(recipe, s, cuda, mlp_only=True)
    if mode in ("fp32", "mixed"):
        return 4 * intermediates
    if mode == "half":
        return 2 * intermediates
    lora = recipe.lora  # lora, qlora: gate's output, the activation and up's output in 16 bits; the adapters'
    on_mlp = [lin for lin in s.lora_linears(lora.target_modules) if s.in_mlp(lin)]
    return 2 * intermediates - (2 * s.intermediate if s.gated_mlp else 0) + adapter_bytes(on_mlp, recipe, mode, cuda)


def shared_mlp_input_bytes(recipe: Recipe, s: Structure, mode: str) -> int:
    """Per token, the MLP's input as mlp_bytes counts it: the one tensor LoRA's adapters on gate and up keep (16-bit
    LoRA: adapter_bytes), which the tiled MLP keeps whole, not a tile of it (training.tiling.TiledMLP saves its
    input; found live at a tiled step's peak on CPU). 0 where mlp_bytes counts no input of the MLP's."""
    if mode != "lora" or recipe.keeps_dropout:
        return 0
    reads = {lin.name for lin in s.lora_linears(recipe.lora.target_modules)} & {"gate_proj", "up_proj"}
    return 2 * s.hidden if reads else 0


def layer_activation_bytes(recipe: Recipe, s: Structure, mode: str, b: int, seq: int, attention: str,
                           cuda: bool = False) -> int:
    """Bytes one decoder layer saves for backward (Korthikanti et al. 2022's counting, redone for
    what transformers' Llama layers and PyTorch autograd really keep; docs/memory.md). `s`: the layer's group
    (Structure.groups); `attention`: the kernel that runs (planning.attention.pick_attention); `cuda`: on a GPU
    (what dropout keeps differs)."""
    h, kv, i, a, T = s.hidden, s.kv_dim, s.intermediate, s.heads, b * seq
    gated = s.gated_mlp
    moe = s.experts > 0  # the MLP is routed experts, counted below
    mlp = 0 if moe else (4 if gated else 2) * i  # gated: gate, act, up, act*up; plain: fc1 out, act out
    q_reads = 3 if any(lin.name == "q_proj" for lin in s.linears) else 1  # separate q/k/v casts
    up_reads = 2 if gated and any(lin.name == "up_proj" for lin in s.linears) else 1
    if mode == "fp32":
        per_token = 4 * (8 * h + 2 * kv + mlp)
        if recipe.lora is not None:
            per_token -= frozen_fp32_bytes(recipe, s, cuda)
    elif mode == "mixed":  # fp32 residual and norms; each linear saves its own bf16 cast of its input
        per_token = 4 * h * 4 + 2 * h * (q_reads + up_reads) + 2 * (2 * h + 2 * kv) + 2 * mlp
    else:  # half weights: norms upcast to fp32 (saved), the rest in 16-bit
        per_token = 20 * h + 4 * kv + 2 * mlp
        if mode in ("lora", "qlora"):
            lora = recipe.lora
            targets = s.lora_linears(lora.target_modules)
            per_token -= 8 * h + (2 * i if gated and not moe else 0)  # frozen linears and norms no longer keep their inputs
            per_token += adapter_bytes(targets, recipe, mode, cuda, attention)
        if mode == "qlora":
            per_token += 33 * h // 2  # the fp32 residual stream and norms (measured, Llama + bnb 4-bit)
    per_token += 8 + 4 * a  # two fp32 rsqrt vectors, SDPA's log-sum-exp per head
    per_token += more_norms_bytes(s)
    if moe:  # top-k routing over transformers 5's fused experts (its batched kernels, measured): per routed
        # token the expert's gate/up output, activation and product (4 x intermediate) and its gathered input and
        # output (2 x hidden), in the experts' weight dtype (autocast does not cast them), three int64 indices
        # and two fp32 weights; per token the router's fp32 probabilities and int64 top-k indices
        eb = 4 if mode in ("fp32", "mixed") else 2
        per_token += s.top_k * (eb * (4 * i + 2 * h) + 32) + 4 * s.experts + 8 * s.top_k
    total = T * per_token
    if recipe.lean_norms:  # each of the two norms keeps its input, not an fp32 copy and (trained) its output
        total -= T * 2 * lean_norm_saving(mode, h, frozen=recipe.lora is not None)
        if recipe.checkpoints:  # the first norm's input is the layer's, which the checkpoint keeps already
            total -= T * residual_bytes(mode) * h
    if recipe.tiled_mlp is not False and not moe:  # the MLP's tensors exist for one tile, in its backward
        others = T - tile_tokens(recipe.tiled_mlp, T, h)
        total -= others * (mlp_bytes(recipe, s, mode, cuda) - shared_mlp_input_bytes(recipe, s, mode))
    cb = compute_bytes(mode)  # the attention's compute dtype
    repeated = T * (a * s.head_dim - kv) * 2 * cb  # K and V copied to every query head (transformers' repeat_kv)
    square = square_bytes(attention, recipe.packing, b, seq, a, mode == "fp32", mask_window(recipe.query_chunks, s.window))
    if attention == "eager":  # the s x s scores: fp32 softmax (+ its 16-bit copy), k/v repeated, no log-sum-exp
        total += square + repeated - T * 4 * a
    elif square:  # sdpa under a mask: K/V repeated, the mask made additive
        total += repeated + square
    if mode == "mixed":
        total += 2 * sum(lin.params for lin in s.linears)  # autocast's bf16 weight copies, saved for backward
    if mode in ("lora", "qlora"):  # ... and of the fp32 adapters
        total += 2 * sum(recipe.lora.r * (lin.in_features + lin.out_features) for lin in targets)
        # (what trains on them: peft's own shapes, read off the meta model, as states.trainable_tensors does)
        on_experts = [t for t in lora_tensors_on_meta(s.config or {}, recipe.lora) if ".experts." in t.name
                      and f".layers.{s.first}." in t.name] if moe else []
        if on_experts:  # peft's ParamWrapper runs the experts on W + BA: that merged weight is saved, in
            total += 2 * s.expert_params + 2 * sum(t.numel for t in on_experts)  # 16 bits, with its factors' casts
    return total


def frozen_fp32_bytes(recipe: Recipe, s: Structure, cuda: bool, mlp_only: bool = False) -> int:
    """Per token, what a layer under LoRA in fp32 (`mixed_precision: no`: no autocast, peft's forward as it is) keeps
    less than the same layer fully fine-tuned, net of its adapters: its two norms keep no normalised input for a
    frozen weight, nor a frozen linear its input (where no adapter reads that tensor undropped: the attention output
    o_proj reads is kept by the kernel anyway, the MLP's input by the tiled MLP); each adapter keeps its rank-r
    output and, with dropout, its dropped copy of its input and dropout's mask or noise (peft's dropout is kept in
    fp32: Recipe.keeps_dropout). `mlp_only`: the MLP's share (mlp_bytes), its input left out. Measured on CPU
    (tests/unit/planning/test_activations.py): without it the plan was 0.72x a step's peak with the recipes'
    dropout and 1.17x without."""
    lora, h = recipe.lora, s.hidden
    assert lora is not None
    linears = [lin for lin in s.linears if not mlp_only or s.in_mlp(lin)]
    targets = [lin for lin in s.lora_linears(lora.target_modules) if lin in linears]
    adapted = {lin.name for lin in targets}
    dropped = bool(lora.dropout)
    saved = 4 * lora.r * len(targets)
    if dropped:
        saved += sum(lin.in_features for lin in targets) * (4 + dropout_bytes(cuda, 4))
    kept = {"o_proj"} | ({"gate_proj", "up_proj"} if mlp_only or recipe.tiled_mlp is not False else set())
    freed, seen = 0 if mlp_only else 8 * h, set()
    for lin in linears:
        tensor = input_of(lin.name)
        if tensor in seen or lin.name in kept:
            continue
        seen.add(tensor)
        if dropped or not (tensor & adapted):
            freed += 4 * lin.in_features
    return freed - saved


def more_norms_bytes(s: Structure) -> int:
    """Per token, what a layer's norms beyond Llama's two keep, each an fp32 copy of its input and an rsqrt a row:
    Qwen3's, Gemma 3's and OLMo 2's of the query and the key (of the projections' outputs, which Llama's layers keep
    nothing of), Gemma 2's and 3's after attention and the MLP (hidden-wide). Measured on CPU
    (tests/unit/planning/test_activations.py)."""
    qk, rows = s.qk_norms
    return 4 * qk + 4 * rows + (2 * (4 * s.hidden + 4) if s.model_type in SANDWICH_NORMED else 0)


def lean_norm_saving(mode: str, h: int, frozen: bool = False) -> int:
    """Per token, what one lean norm (training.norms) keeps less than transformers' RMSNorm: that one keeps its input
    in fp32 (a copy where the residual stream is 16-bit) and, when its weight trains, its output; the lean one keeps
    its input as it comes (measured on CPU: tests/unit/planning/test_activations.py). `frozen`: under LoRA (in fp32
    the input needs no copy, and the output is not kept)."""
    trains = mode in ("fp32", "mixed", "half") and not frozen
    return 4 * h if trains else (4 - residual_bytes(mode)) * h


def attention_backward_bytes(s: Structure, mode: str, tokens: int, cuda: bool, attention: str = "sdpa",
                             chunk: int = 0, sp: int = 1) -> int:
    """What the attention kernel's backward allocates beside the layer's saved tensors (the MLP's freed by then): the
    gradients of q, k and v, the gradient of the attention's output (`dout`, o_proj's input gradient: an argument of
    the kernel's backward, alive throughout it), and the kernel's working buffers:
    - flash-attn 2 and torch's copy of its kernel under sdpa, on a GPU: K's and V's gradients at every query head
      (expanded under GQA, then summed into their own heads), the fp32 dq accumulator and row sums (flash-attn's
      csrc/flash_attn/flash_api.cpp, mha_varlen_bwd(dout, ...): dq_accum, softmax_d, dk_expanded; torch's sdpa,
      _scaled_dot_product_flash_attention_backward(grad_out, ...)). dout was the one of two [tokens x hidden] terms
      the third lease's H200 rows found missing under sdpa (docs/gpu.md).
    - flex_attention (compiled; torch/_inductor/kernel/flex/flex_attention.py, flex_attention_backward): dq at the
      query's heads, dk and dv at K's and V's own heads (written by the kernel, no expansion, no fp32 accumulator:
      each query block's dq is summed in registers), and `delta`, the fp32 row sums of out x dout.
    - on CPU (torch's FlashAttentionKernel.cpp, measured): K and V repeated to every query head, grad_out made
      contiguous (which stands for dout) and each thread's fp32 and 16-bit blocks of scores (256 x 512 from 768
      tokens).
    - under query_chunks (`chunk` queries a call: attention.chunked, training.query_chunks.QueryChunkedAttention),
      each block of a chunk of queries and a chunk of keys one call of the kernel's backward: dq for the whole
      sequence (written a query chunk at a time) and the fp32 sums of dK and dV (rounded to 16 bits a key chunk at a
      time, then joined: as much again at the end), beside one call's buffers, mha_bwd's as above over a chunk of
      queries and one of keys, and the query chunk's fp32 dq sum; on CPU, torch's CPU kernel for that block (its
      buffers measured: tests/unit/training/test_query_chunks.py). In a sliding-window layer whose row passes its
      window (`s.window`: training.query_chunks.BandedAttention) a chunk of queries and the chunk + window - 1 keys
      its window reaches, one call: no dq sum, the key side's buffers over the band (on CPU its additive mask too).
      Under Ulysses (`sp`; `tokens` a slice's) a chunk of the whole sequence's queries at 1/sp of the heads: as
      many bytes as chunk / sp queries at all of them."""
    cb = compute_bytes(mode)
    per_head = s.heads * s.head_dim
    dout = tokens * cb * per_head
    if chunk:
        return dout + chunks_backward_bytes(s, cb, tokens, cuda, chunk, sp)
    if cuda and attention == "flex_attention":
        return dout + tokens * (cb * (per_head + 2 * s.kv_dim) + 4 * s.heads)  # dq, dk and dv, delta
    grads = tokens * 3 * cb * per_head
    if cuda:
        return grads + dout + tokens * (2 * cb * s.kv_dim + 4 * (per_head + s.heads))
    block = cpu_query_block(tokens) * min(CPU_KEY_BLOCK, tokens)
    return grads + dout + usable_cores() * block * (8 + (4 if cb == 2 else 0))


def chunks_backward_bytes(s: Structure, cb: int, tokens: int, cuda: bool, chunk: int, sp: int) -> int:
    """attention_backward_bytes under query chunks (`cb`: the compute dtype's bytes), beside the output's gradient."""
    per_head = s.heads * s.head_dim
    share, row = -(-chunk // sp), tokens * sp  # (the chunk's queries at all heads that hold as much)
    banded = 0 < s.window < row  # (BandedAttention: one call a chunk over the keys its window reaches)

    def call(band: int) -> int:  # one call's buffers, over `band` keys
        keys = -(-band // sp)
        grads = share * cb * per_head + keys * 2 * cb * s.kv_dim  # dq, dk and dv
        dq_sum = 0 if banded else share * 4 * per_head  # the query chunk's fp32 dq sum over its key chunks
        if cuda:  # mha_bwd's dk and dv at every query head (GQA), dq_accum and softmax_d
            expanded = 2 * cb * per_head if s.kv_heads != s.heads else 0
            return grads + dq_sum + keys * expanded + share * 4 * (per_head + s.heads)
        block = cpu_query_block(chunk) * min(CPU_KEY_BLOCK, band) * (8 + (4 if cb == 2 else 0))
        if banded:  # torch's CPU kernel beside the band's additive mask (made for the call) and every
            # thread's fp32 and 16-bit blocks of scores (FlashAttentionKernel.cpp, cpu_flash_attention_backward:
            # buf, buf_reduced)
            return grads + chunk * band * cb + usable_cores() * block
        # torch's CPU kernel: a second copy of the block's gradients, and the blocks of every thread but the
        # first (measured: tests/unit/training/test_query_chunks.py; the first's is not live at the peak)
        return 2 * grads + dq_sum + (usable_cores() - 1) * block

    if not banded:  # dq; dK's and dV's fp32 sums (or their join) over the sequence; a block's call
        return tokens * (cb * per_head + max(8, 4 * cb) * s.kv_dim) + call(chunk)
    calls, live = -(-row // chunk), -(-(s.window - 1) // chunk)  # live: the key chunks a band reaches before its own

    def during(i: int) -> int:  # the i-th query chunk's call (walked from the last): dq, the key chunks after
        # it rounded, those the band before it reached still in fp32
        end = min((i + 1) * chunk, row)
        return (tokens * cb * per_head + (row - end) // sp * 2 * cb * s.kv_dim
                + min(live, i + 1) * share * 8 * s.kv_dim + call(end - max(0, i * chunk - s.window + 1)))

    join = tokens * (cb * per_head + 4 * cb * s.kv_dim)  # dK's and dV's rounded chunks joined
    return max(join, *(during(min(i, calls - 1)) for i in (0, live - 1, live)))


def exchange_bytes(s: Structure, mode: str, tokens: int, sp: int) -> int:
    """Ulysses' exchanges in a layer's backward, on a process holding `tokens` of a sequence split `sp` ways, net of
    what is freed by then: the gradients of q, k and v pass the all-to-alls back once the attention kernel's backward
    has returned, each exchange making its input contiguous and writing a new output beside it
    (deepspeed/runtime/sequence_parallel/ulysses_sp.py, _combine_local_sequences), while the kernel's working buffers
    and the tensors it kept (q, k, v, its output) are freed. After the exchange a process holds kv_heads / sp
    key/value heads of the whole sequence, at least one (replicated where sp outnumbers them). Negative for every
    model here: below the kernel's own place, as measured on 2 gloo processes (tests/runs/test_sequence_parallel.py:
    no bytes per token above one process at the slice's length)."""
    cb, d = compute_bytes(mode), s.head_dim
    kv = max(s.kv_heads, sp) * d
    return tokens * cb * (s.heads * d + 2 * kv) - tokens * cb * (2 * s.heads * d + 2 * kv)


def replicated_kv_bytes(s: Structure, mode: str, tokens: int, sp: int) -> int:
    """The K and V heads Ulysses replicates when sp outnumbers them, kept by the attention kernel for backward."""
    return 2 * tokens * compute_bytes(mode) * max(0, sp - s.kv_heads) * s.head_dim


def exchanged_output_bytes(recipe: Recipe, s: Structure, mode: str, tokens: int, sp: int, attention: str) -> int:
    """Under Ulysses o_proj reads the exchange's output (deepspeed/runtime/sequence_parallel/ulysses_sp.py,
    _partition_global_sequence: an all-to-all, then a contiguous copy), not the kernel's saved output it reads on one
    process (adapter_bytes, KEEPS_ITS_OUTPUT): where o_proj keeps its input for backward (it trains, or its adapter
    reads its input as it comes), one [tokens x heads x head_dim] more, kept beside the kernel's."""
    if sp == 1 or attention not in KEEPS_ITS_OUTPUT:
        return 0
    if mode in ("lora", "qlora"):  # (an adapter keeping peft's dropout or QLoRA's cast keeps its own copy anyway)
        targets = s.lora_linears(recipe.lora.target_modules)
        if mode == "qlora" or recipe.keeps_dropout or not any(lin.name == "o_proj" for lin in targets):
            return 0
    return tokens * compute_bytes(mode) * s.heads * s.head_dim


def ring_bytes(s: Structure, mode: str, tokens: int, cp: int) -> int:
    """Ring attention's buffers in a layer's backward, on a process holding `tokens` of a sequence split `cp` ways
    (torch's _context_parallel/_attention.py, _templated_ring_attention_backward, with accelerate's default
    cp_comm_strategy allgather): every process's keys and values gathered once (_AllGatherRotater), the fp32
    accumulators of the query's and the local keys' and values' gradients (convert_to_f32), and the keys' and values'
    gradients passed on around the ring. Key/value heads as the model has them (transformers' sdpa passes
    enable_gqa when there is no mask, and accelerate drops it). Read off the sources, not measured: CPU has no ring
    kernel."""
    cb, kv, q = compute_bytes(mode), 2 * s.kv_heads * s.head_dim, s.heads * s.head_dim
    return cp * tokens * kv * cb + tokens * (q + kv) * 4 + tokens * kv * 4


def backward_peak(recipe: Recipe, s: Structure, mode: str, tokens: int, saved: int, cuda: bool = False,
                  sp: int = 1, attention: str = "sdpa", chunk: int = 0) -> int:
    """The most one layer holds while backward runs through it: `saved` (what it keeps, layer_activation_bytes) with
    what is allocated beside it, at the largest of three places (the CPU profiler's allocation peak inside a
    recomputed layer's backward, tests/unit/planning/test_activations.py), each beside the gradient arriving at the
    layer, in the residual stream's dtype:
    - the MLP's product in backward: its other tensors still held, the down projection's saved input freed, three
      [tokens x intermediate] gradients in the compute dtype (by the frozen linear and by the adapter, then their
      sum; then the product's, the activation's and up's); a tile's worth under tiled_mlp, beside the MLP input's
      gradient (whole from the first tile) and the tile's own sum of it;
    - the down projection's adapter in the recompute, where peft casts its 16-bit input (the MLP's product, held by
      nothing else) to fp32 (with dropout, and under QLoRA: training.adapters.share_inputs) and dropout writes its
      mask and its fp32 output (mlp_places: with adapters in 16 bits, what peft's kept dropout leaves live there);
    - the norm after attention, the MLP's tensors freed: RMSNorm's backward works in fp32 (five [tokens x hidden]);
      under lean_norms, four over a tile of hidden_size tokens (training.norms.LeanRMSNorm.backward: the normed
      input, the upstream gradient, and two of the three products after them), beside its output's gradient (the MLP
      input's) and its input's;
    - the attention kernel's backward (attention_backward_bytes, by kernel; `chunk`: query_chunks'), the norm after it and o_proj's adapter's
      rank-r output freed too;
    - with LoRA's dropout redrawn (training.adapters.recompute_dropout), an adapter outside the MLP (o_proj; q, k
      and v hold less there) over the whole sequence (a tile of it under tiled_mlp): its fp32 input, the mask and the
      fp32 dropped input, made again in its backward beside the attention's kept tensors (the third lease's
      flex_attention row: 9.0 of the 14.1 GiB live at its peak, training/adapters.py `dropped`), and the frozen
      linear's output from the layer's recompute (peft's lora/layer.py `result = self.base_layer(x)`, found live
      there on CPU with stand-ins for the CUDA kernels: tests/unit/planning/test_activations.py).
    Under Ulysses (`sp`), a fourth: the exchanges after the attention's backward (exchange_bytes); under ring
    attention (parallelism.cp_size), the ring's buffers beside the kernel's backward (ring_bytes)."""
    cb = compute_bytes(mode)
    residual = residual_bytes(mode)
    mlp_tokens = tokens if recipe.tiled_mlp is False else tile_tokens(recipe.tiled_mlp, tokens, s.hidden)
    lora = recipe.lora
    norm = norm_backward_bytes(recipe, s, residual, tokens)
    shared = shared_mlp_input_bytes(recipe, s, mode)
    # (its input, kept whole by the tiled MLP, freed with the rest)
    mlp_freed = saved - mlp_tokens * mlp_bytes(recipe, s, mode, cuda) - (tokens - mlp_tokens) * shared
    # by the attention's backward, the norm after it and the MLP's input are freed too
    after_attention = tokens * s.hidden * (residual if recipe.lean_norms else 4) + tokens * (
        cb * s.hidden - shared)  # (the MLP's input, where mlp_bytes did not count it)
    # ... and o_proj's adapter's rank-r output, its backward done
    o_rank = 2 * lora.r * tokens if lora and any(lin.name == "o_proj" for lin in s.lora_linears(
        lora.target_modules)) else 0
    places = [mlp_freed + norm,
              mlp_freed - after_attention - o_rank + attention_backward_bytes(s, mode, tokens, cuda, attention, chunk,
                                                                              sp)]
    if s.model_type in NORM_AFTER_MLP:  # the norm after the MLP: its backward first, the MLP's tensors still held
        # (under tiled_mlp none of a tile's yet: TiledMLP's backward makes them after it)
        places.append(saved + norm - (mlp_tokens * mlp_bytes(recipe, s, mode, cuda) if mlp_tokens < tokens else 0))
    redraw = redraw_bytes(recipe, mode, cuda)
    outside = outside_redraw_bytes(recipe, s, tokens, cb, redraw) if redraw else 0
    if outside:
        places.append(mlp_freed - after_attention + outside)
    if sp > 1:  # the exchanges, after the kernel's backward: its gradients of q, k, v passing them
        places.append(mlp_freed - after_attention + 3 * tokens * cb * s.heads * s.head_dim
                      + exchange_bytes(s, mode, tokens, sp))
    if recipe.context_parallel > 1:  # the kernel's place, the ring's buffers beside it
        places.append(places[1] + ring_bytes(s, mode, tokens, recipe.context_parallel))
    if not s.experts:
        places += mlp_places(recipe, s, mode, tokens, mlp_tokens, saved, cuda)
    return max(places) + tokens * residual * s.hidden


def norm_backward_bytes(recipe: Recipe, s: Structure, residual: int, tokens: int) -> int:
    """A hidden-wide RMSNorm's backward buffers: transformers' five fp32 [tokens x hidden]; a lean norm's output's
    gradient and its input's, and four fp32 buffers over a tile of hidden_size tokens."""
    if recipe.lean_norms:
        return 2 * tokens * residual * s.hidden + 16 * min(tokens, s.hidden) * s.hidden
    return tokens * 20 * s.hidden


def mlp_places(recipe: Recipe, s: Structure, mode: str, tokens: int, mlp_tokens: int, saved: int,
               cuda: bool) -> list[int]:
    """backward_peak's places in a dense MLP's backward, over `mlp_tokens` (a tile's under tiled_mlp): its product's
    gradients, and the down projection's redrawn dropout; with adapters in 16 bits (DeepSpeed's engine) with
    dropout, the recompute at the down projection's A: the product, the frozen linear's output, the layer's residual
    and the MLP's input beside what the layer keeps."""
    cb, i, lora = compute_bytes(mode), s.intermediate, recipe.lora
    down = [lin for lin in s.lora_linears(lora.target_modules) if lin.name == "down_proj"] if lora else []
    if down:  # what the down projection keeps of its input, freed once its backward ran
        kept = adapter_bytes(down, recipe, mode, cuda) - cb * lora.r
    else:  # a trained linear keeps its input in the compute dtype, a frozen one nothing
        kept = 0 if lora else cb * i
    # under tiled_mlp, the MLP input's gradient is whole from its first tile, and a tile's own sum of it beside it,
    # before autograd adds it in (training.tiling.TiledMLP)
    input_gradient = (tokens + mlp_tokens) * residual_bytes(mode) * s.hidden if mlp_tokens < tokens else 0
    places = [saved + mlp_tokens * (3 * cb * i - kept) + input_gradient]
    redraw, half = redraw_bytes(recipe, mode, cuda), half_adapters(recipe, mode)
    if down and (mode == "qlora" or (mode == "lora" and lora.dropout and not half)):
        # a redrawn dropout's mask, which the layer does not keep, is made again beside them (with fp32 adapters the
        # cast copy of the product too, with or without dropout)
        places.append(saved + mlp_tokens * ((redraw or (8 if lora.dropout else 4)) + cb) * i + input_gradient)
    elif down and lora.dropout:
        if redraw:  # 16-bit adapters (DeepSpeed's engine) redraw the mask and the dropped product beside its gradient
            places.append(saved + mlp_tokens * (redraw + cb) * i + input_gradient)
        if recipe.checkpoints:  # (selective checkpointing replays the layer too, its matmuls from the cache)
            # adapters in the compute dtype (16 bits under DeepSpeed's engine; fp32 runs too, which no autocast casts
            # for): at the down projection's A in the layer's recompute (a redraw's recompute stops at the A's own
            # checkpoint, before its dropout: torch's early stop), its input (the MLP's product, which nothing keeps)
            # and its frozen linear's output (peft's `result = self.base_layer(x)`), and the layer's residual and the
            # MLP's input, which the layer's forward holds while the MLP runs and nothing saves, beside what the layer
            # keeps (each found live there on CPU)
            places.append(saved + mlp_tokens * cb * (i + s.hidden) + tokens * (residual_bytes(mode) + cb) * s.hidden
                          + input_gradient)
    return places


def redraw_bytes(recipe: Recipe, mode: str, cuda: bool) -> int:
    """Per element of an adapter's input, what its dropout redrawn in backward makes again (training.adapters.dropped:
    not compiled, not `lora.redraw_dropout: false`, not in fp32): fp32 adapters (under autocast) an fp32 copy of the
    input, the mask and the fp32 dropped input; 16-bit ones (DeepSpeed's engine) read their input as it comes, the
    mask and the dropped input in 16 bits. 0 where it is not redrawn."""
    if not (recipe.redraws_dropout and mode in ("lora", "qlora")):
        return 0
    return 2 + dropout_bytes(cuda, 2) if half_adapters(recipe, mode) else 8 + dropout_bytes(cuda)


def outside_redraw_bytes(recipe: Recipe, s: Structure, tokens: int, cb: int, redraw: int) -> int:
    """The widest adapter outside the MLP redrawing its dropout in its backward (o_proj's: `redraw` bytes an element
    of its input, redraw_bytes), beside the frozen linear's output from the layer's recompute (backward_peak). Under
    tiled_mlp the redraw runs a tile at a time (training.tiling.tile_redraws): a tile's, beside its input's gradient,
    whole from the first tile (training.tiling.TiledMLP)."""
    outside = [lin for lin in s.lora_linears(recipe.lora.target_modules)
               if s.intermediate not in (lin.in_features, lin.out_features)]
    if not outside:
        return 0
    widest = max(outside, key=lambda lin: lin.in_features)
    width = widest.in_features
    made = tokens * redraw * width
    if recipe.tiled_mlp is not False:
        tile = tile_tokens(recipe.tiled_mlp, tokens, width)
        made = tile * redraw * width + tokens * cb * width
    return made + tokens * cb * widest.out_features


def selective_bytes(recipe: Recipe, s: Structure, mode: str, tokens: int) -> int:
    """What one layer keeps under selective checkpointing beside its input (training.layers.selective_policy):
    every matmul's output (the linears', and LoRA's A and B) in the compute dtype, attention's output and its
    fp32 log-sum-exp per head; none of a tiled MLP's (training.layers.selective_policy). Measured on CPU:
    tests/unit/planning/test_activations.py."""
    cb = compute_bytes(mode)
    linears = [lin for lin in s.linears if recipe.tiled_mlp is False or not s.in_mlp(lin)]
    outputs = sum(lin.out_features for lin in linears) + s.heads * s.head_dim
    if recipe.lora is not None:
        outputs += sum(recipe.lora.r + lin.out_features for lin in s.lora_linears(recipe.lora.target_modules)
                       if lin in linears)
    return tokens * (cb * outputs + 4 * s.heads)


def selective_forward_bytes(recipe: Recipe, s: Structure, mode: str, tokens: int) -> int:
    """What the last layer's forward holds beside its selective cache, all layers' caches made (the matmuls' outputs,
    selective_bytes): the layer's residual and the MLP's input, held by the layer's and the MLP's frames, and the
    largest of two moments in the MLP: at the up projection's adapter, the activation's output beside peft's scaled
    adapter output and its sum with the cached frozen one (`result + lora_B(...) * scaling`, neither cached), the down
    projection's outputs not cached yet; at the down projection's adapter, its input (the product) beside the same
    two. Found as the step's peak for fp32 LoRA on every linear on CPU (the plan 0.95x without it)."""
    cb, h, i = compute_bytes(mode), s.hidden, s.intermediate
    adapted = {lin.name for lin in s.lora_linears(recipe.lora.target_modules)} if recipe.lora else set()
    held = (residual_bytes(mode) + (2 if mode in ("lora", "half") else 4)) * h * tokens
    down = cb * (h + (recipe.lora.r + h if "down_proj" in adapted else 0))  # (recipe.lora is set where adapted)
    if recipe.tiled_mlp is not False:  # the MLP runs a tile at a time, none of it cached
        tokens, down = tile_tokens(recipe.tiled_mlp, tokens, h), 0
    at_up = cb * i * (1 + (2 if "up_proj" in adapted else 0)) - down
    at_down = cb * (i + (2 * h if "down_proj" in adapted else 0))
    return held + tokens * max(at_up, at_down) if s.gated_mlp and not s.experts else held


def loss_bytes(recipe: Recipe, s: Structure, mode: str, b: int, T: int, head_copy: int) -> tuple[int, int, int]:
    """The loss's bytes for T tokens: (what it keeps for backward, its working bytes, the head's autocast weight copy
    left to count beside the layers: none when the fused head counts it)."""
    h, V = s.hidden, s.vocab
    residual = residual_bytes(mode)
    if recipe.fused_loss:  # the chunks keep their inputs (the target positions' hidden states, planned as all)
        saved_logits = T * h * residual
        # forward, a chunk at a time: its fp32 logits and their log-sum-exp's temporary, 8 bytes a logit (12 through a
        # wrapped head: LoRA on lm_head runs its own forward under checkpointing, autograd's three fp32 [chunk x
        # vocab]), beside the head's weights cast once under autocast. Backward (HeadLoss) walks the head in blocks
        # of rows: the input's gradient summed in fp32, a trained head's gradient written out (the window holds it),
        # each block's fp32 sum and product (a quarter of a chunk's logits each). Beside both, the chunks' inputs.
        # Measured by tests/workers/head_loss_bytes.py (benchmarks/loss_memory.py --chunks).
        wrapped = recipe.lora is not None and "lm_head" in recipe.lora.target_modules
        cV = min(recipe.loss_chunk_tokens, T) * V
        forward = (12 if wrapped else 8) * cV + head_copy
        backward = 4 * T * h
        if recipe.lora is None:  # a trained head
            backward += V * h * (2 if mode == "half" else 4) + 2 * cV
        logits, head_copy = max(forward, backward) + T * h * residual, 0
    else:
        saved_logits = (T - b) * V * 4  # fp32 log-softmax kept for the loss's backward
        logits = 12 * T * V  # the same three fp32 [tokens x vocab] at the log-softmax's backward (measured)
    return saved_logits, logits, head_copy


def embedding_gradient_bytes(recipe: Recipe, s: Structure, mode: str) -> tuple[int, int]:
    """(held through every layer's backward, held as backward ends) by the token embedding's gradient in a micro batch
    after the first of a step, in a full fine-tune whose gradients are whole on each process (one process, DDP).
    There autograd writes each gradient out before adding it to the .grad the first micro batch left (the first's
    becomes the .grad, counted with the gradients). A head tied to the embedding gets its gradient at the loss, and
    autograd keeps it in the shared weight's input buffer until the embedding's arrives at the end of backward, so
    every layer's backward runs beside it; then the two are summed. Untied, only the embedding's own, at the end.
    (The second GPU lease's adamw-8bit row, Llama-3.2-1B tied: allocator peak 0.95 GiB above the plan; this term is
    0.98 GiB. Measured on CPU: tests/unit/planning/test_activations.py.) FSDP and DeepSpeed shard or reduce
    gradients as they come: not counted there."""
    trains = mode in ("fp32", "mixed", "half") and recipe.lora is None and recipe.gradient_accumulation_steps > 1
    if not trains or recipe.distributed_type not in ("no", "ddp"):
        return 0, 0
    gradient = s.vocab * s.hidden * (2 if mode == "half" else 4)
    return (gradient, 2 * gradient) if s.tied_embeddings else (0, gradient)


def slice_layer_bytes(recipe: Recipe, g: Structure, mode: str, b: int, seq: int, attention: str, cuda: bool,
                      sp: int) -> int:
    """What one layer of the group `g` keeps on a process holding `seq` tokens of each row (a slice under Ulysses):
    layer_activation_bytes, split by tensor parallelism, and what Ulysses adds beside it."""
    T = b * seq
    return (layer_activation_bytes(recipe, g, mode, b, seq, attention, cuda) // recipe.tensor_parallel
            + replicated_kv_bytes(g, mode, T, sp) + exchanged_output_bytes(recipe, g, mode, T, sp, attention))


def activation_bytes(recipe: Recipe, s: Structure, mode: str, b: int, seq: int, attention: str | None = None,
                     cuda: bool = False, sp: int = 1) -> dict:
    """One micro batch on one process: `activations` and `logits` (the categories), `saved_peak` (most
    bytes held for backward at once), `forward_saved` (held when the forward ends), `layer` (one layer's),
    `host` (checkpointed inputs moved to host memory by activation_offload). `attention`: the kernel that runs
    (planning.attention.pick_attention; None: what runs on CPU); `cuda`: planned for a GPU. `sp`: Ulysses' group,
    whose processes each hold seq / sp tokens of every tensor; the attention's tensors, whole sequences for 1/sp of
    the heads, are as large as the slice's for all of them, but for replicated K/V heads and the exchanges' buffers
    (exchange_bytes, replicated_kv_bytes). Ring attention (parallelism.cp_size) splits every tensor cp ways, the
    attention's too, and passes keys and values around (ring_bytes)."""
    row, seq = seq, -(-seq // (sp * recipe.context_parallel))
    h, V, T = s.hidden, s.vocab, b * seq
    if attention is None:  # the kernel on CPU (what the tests measure)
        attention = pick_attention(recipe.attn_implementation, cuda=False, half=mode != "fp32", packing=recipe.packing,
                                   flash=False, flex=False, sdpa=s.sdpa).name
    # tensor parallelism splits each layer's attention and MLP over tp_size processes (counted as if the
    # norms were split too: optimistic by ~10 bytes x hidden per token and layer); inputs stay whole
    tp = recipe.tensor_parallel
    layers = [(g.layers, slice_layer_bytes(recipe, g, mode, b, seq, attention, cuda, sp), g) for g in s.groups()]
    layer = max(one for _, one, _ in layers)  # the largest layer's (one is recomputed at a time)
    # (query_chunks: queries a call of the whole row, under Ulysses too, in each group's layers; 0: the row whole)
    in_backward = max(layer_backward_bytes(recipe, g, mode, T, one, tp, cuda, sp, attention,
                                           chunked(recipe.query_chunks, attention, recipe.packing, b, row, g.window))
                      for _, one, g in layers)
    every_layer = sum(n * one for n, one, _ in layers)
    host = 0
    residual = residual_bytes(mode)
    norm = final_norm_bytes(recipe, mode, T, h)
    head_copy = 2 * V * h if mode in ("mixed", "qlora") else 0  # lm_head's bf16 weight copy (autocast)
    small = small_bytes(recipe, s, mode, attention, b, seq)
    saved_logits, logits, head_copy = loss_bytes(recipe, s, mode, b, T, head_copy)
    waiting, embedding_end = embedding_gradient_bytes(recipe, s, mode)
    final_norm = norm_backward_bytes(recipe, s, residual, T)
    if recipe.checkpoints:
        inputs = s.layers * T * h * residual  # each layer keeps only its input; one layer is recomputed at a time
        if recipe.gradient_checkpointing == "selective":  # ... and its matmuls' and attention's outputs
            inputs += sum(g.layers * selective_bytes(recipe, g, mode, T) // tp for g in s.groups())
        if recipe.activation_offload:  # ... in host memory; on the device the one its layer's recompute uses and
            host, inputs = inputs, 2 * T * h * residual  # the next, prefetched (layers.HostOffload)
        forward_saved = inputs + small + norm + head_copy + saved_logits
        saved_peak = max(forward_saved, inputs + small + layer)  # the loss's tensors are gone by the recompute
        acts = inputs + small + max(layer, norm + head_copy)
        # (autocast over fp32 weights would hold every layer's 16-bit weight copy here, in its cache: the loop
        # turns the cache off, training.accelerator)
        working = max(inputs + small + norm + head_copy + logits,  # the loss,
                      inputs + small + norm + final_norm,  # the final norm's backward (under selective, beside
                      inputs + small + in_backward + waiting)  # every layer's outputs), or a layer's backward
        if recipe.gradient_checkpointing == "selective":  # ... or the last layer's forward, every cache made
            working = max(working, inputs + small + selective_forward_bytes(recipe, s, mode, T) // tp)
    else:
        acts = every_layer - first_norm_bytes(recipe, s, mode, T, cuda) // tp + small + norm + head_copy
        forward_saved = saved_peak = acts + saved_logits
        # every layer's activations are held at the loss, and at the final norm's backward
        working = acts + max(logits, final_norm, in_backward - layer + waiting)
    working = max(working, small + embedding_end)
    return {"activations": acts, "logits": logits, "saved_peak": saved_peak, "forward_saved": forward_saved,
            "layer": layer, "host": host, "working": working}


def small_bytes(recipe: Recipe, s: Structure, mode: str, attention: str, b: int, seq: int) -> int:
    """What every layer reads and the checkpoints keep beside their inputs: the input ids, rotary cos/sin, flex's
    BlockMask and sdpa's boolean mask, one a kind of layer (full attention, a sliding window), as transformers builds
    them (each model's causal_mask_mapping)."""
    T, kinds = b * seq, tuple(mask_window(recipe.query_chunks, g.window) for g in s.groups())
    rope = T * 2 * s.head_dim * (4 if mode in ("fp32", "mixed", "qlora") else 2)
    return T * 8 + rope + block_mask_bytes(attention, b, seq) * len(set(kinds)) + kept_mask_bytes(
        attention, recipe.packing, b, seq, recipe.checkpoints, kinds)


def final_norm_bytes(recipe: Recipe, mode: str, T: int, h: int) -> int:
    """What the final norm and the head's matmul keep for backward (the fused loss's chunks keep the targets' own)."""
    norm = T * ({"fp32": 12, "mixed": 10, "half": 8, "lora": 4, "qlora": 10}[mode] * h + 4)
    if recipe.fused_loss:  # the head's matmul no longer keeps its input
        norm -= T * h * {"fp32": 4, "mixed": 2, "half": 2, "lora": 0, "qlora": 2}[mode]
    if mode == "fp32" and recipe.lora is not None:  # LoRA in fp32: the frozen weight needs no normalised input
        norm -= T * 4 * h
    if recipe.lean_norms:  # the final norm is lean too
        norm -= T * lean_norm_saving(mode, h, frozen=recipe.lora is not None)
    return norm


def layer_backward_bytes(recipe: Recipe, g: Structure, mode: str, T: int, one: int, tp: int, cuda: bool, sp: int,
                         attention: str, chunk: int = 0) -> int:
    """A layer's backward (backward_peak) beside what the checkpoints keep. Selectively checkpointed, its matmuls'
    outputs are counted with the checkpoints, but for its last matmul's, which the recompute never replays:
    non-reentrant checkpointing stops at the layer's last saved tensor, an input of its last matmul (the down
    projection's, or its adapter's B), packed before that matmul runs, so the output it cached in forward stays in
    the selective cache until the layer's backward ends. A tiled MLP's matmuls are not cached, and the recompute
    replays every cached one."""
    kept = 0
    if recipe.gradient_checkpointing == "selective":
        last = T * compute_bytes(mode) * g.hidden if recipe.tiled_mlp is False else 0
        kept = selective_bytes(recipe, g, mode, T) - last
    return (backward_peak(recipe, g, mode, T, one * tp, cuda, sp, attention, chunk) - kept) // tp


def first_norm_bytes(recipe: Recipe, s: Structure, mode: str, T: int, cuda: bool) -> int:
    """What the first layer's input norm keeps, planned as every layer's, that it does not under LoRA and QLoRA: the
    frozen embedding's output requires no grad (training.adapters.drop_input_grads, not where the layers compile),
    nor does the norm's weight, so it keeps nothing. In fp32 (its rsqrt kept; measured) neither does the dropout of
    the adapters reading the norm's output, a tensor without grad."""
    h = s.hidden
    if recipe.lora is None or recipe.torch_compile or mode not in ("lora", "qlora", "fp32"):
        return 0
    if mode == "fp32":
        reading = [lin for lin in s.lora_linears(recipe.lora.target_modules) if lin.name in ATTENTION_INPUT]
        noise = sum(lin.in_features for lin in reading) * dropout_bytes(cuda, 4) if recipe.lora.dropout else 0
        return T * (4 * h + noise)
    return T * ((residual_bytes(mode) if recipe.lean_norms else 4) * h + 4)


def plan_attention(recipe: Recipe, s: Structure, mode: str, half: bool, batch: int, seq: int, sp: int, cpu: bool,
                   attention: str | None, notes: list[str]) -> tuple[str, dict, str | None]:
    """(the kernel planned, its activations, why it cannot run or None), its notes added. `attention`: the kernel that
    ran (a report's); None: the one a launch will run on the box that runs it, not on this one: the worst of what
    auto takes on a GPU box with flash-attn installed and without. Past flash's and sdpa's 32-bit offsets
    (attention.offset_limit) auto takes flex_attention, and a kernel named there is refused."""
    heads = max(1, s.heads // sp)  # Ulysses: each process attends to whole sequences for 1/sp of the heads
    tokens = batch * seq // recipe.context_parallel
    if attention is None:
        picks = {picked.name: picked for picked in (
            pick_attention(recipe.attn_implementation, cuda=not cpu, half=half, packing=recipe.packing,
                           flash=flash, flex=s.flex and not s.attention_dropout, sequence_parallel=sp > 1,
                           ring=recipe.context_parallel > 1,
                           past_offsets=tokens > offset_limit(heads, s.head_dim), windowed=bool(s.masked_windows(seq)),
                           sdpa=s.sdpa)
            for flash in (True, False))}  # (a GPU box with flash-attn installed, and one without)
        kernels = {name: activation_bytes(recipe, s, mode, batch, seq, name, cuda=not cpu, sp=sp) for name in picks}
        attention = max(kernels, key=lambda name: kernels[name]["working"])
        if attention != recipe.attn_implementation:
            others = [name for name in kernels if name != attention]
            notes.append(f"attention: {attention} ({picks[attention].why})" + (
                f"; the worst of what auto takes on a GPU box with flash-attn installed or not ({others[0]} holds "
                f"less; attn_implementation={others[0]} plans it)" if others else ""))
        act = kernels[attention]
    else:
        act = activation_bytes(recipe, s, mode, batch, seq, attention, cuda=not cpu, sp=sp)
    chunks = [chunked(recipe.query_chunks, attention, recipe.packing, batch, seq, g.window) for g in s.groups()]
    calls = max(chunk or tokens for chunk in chunks)  # (a call's queries)
    wraps = (ring_window_note(recipe.context_parallel, tuple(g.window for g in s.groups()), s.model_type)
             or unsupported_note(attention, s.sdpa, s.flex, s.model_type)
             or dropped_window_note(attention, sp, s.masked_windows(seq), s.model_type, recipe.query_chunks)
             or (chunks_dropout_note(s.attention_dropout) if any(chunks) and s.attention_dropout else None)
             or (None if cpu else offsets_note(attention, calls, heads, s.head_dim)))
    if wraps:  # refused: not a matter of bytes
        notes.append(wraps)
    return attention, act, wraps
