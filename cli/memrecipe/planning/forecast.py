"""How long a step takes, said before launch: each process's work counted from the model and the recipe (FLOPs of the
matmuls and of attention, bytes the adapters and the dequantisation move, copies over the host link and between GPUs)
and divided by the device's rates. Pure Python, like the rest of the planner.

A rate is a datasheet peak times an efficiency, and each efficiency is measured on one named row of a GPU run
(benchmarks/gpu_results), never set to make a row come out right; the other rows check it (benchmarks/forecast.py
prints forecast against measured for every recorded row, docs/speed.md the table). What is counted and what is not:
docs/speed.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from .activations import tile_count
from .architecture import SANDWICH_NORMED, Structure
from .attention import CPU_KEY_BLOCK, chunked, cpu_query_block, mask_window
from .gpus import GPUS, Gpu
from .recipe import Recipe, method

# Efficiencies: the share of the datasheet peak each kind of work reaches on a GPU, each measured on the row named
# (benchmarks/forecast.py --derive recomputes them from benchmarks/gpu_results; docs/speed.md).
# The matmuls of a training step with the small ops between them (norms, RoPE, SwiGLU): adamw-8bit, 1B shape,
# 4 x 2048 tokens, H100 (2026-11-27), less its attention, loss and optimizer step.
MATMUL = 0.348
# Causal attention forward and backward: sdpa from the slope of step time against length between the 128K and 256K
# long-8b rows (H200, 2026-11-27: the same matmuls a token at both, attention's work doubled); flex_attention from
# its 256K row less the sdpa row's time beside attention. flash_attention_2 is given sdpa's figure (sdpa runs torch's
# copy of FlashAttention-2 for these shapes); eager multiplies the [S x S] scores as plain matmuls.
ATTENTION = {"sdpa": 0.624, "flex_attention": 0.422, "flash_attention_2": 0.624}
# LoRA's adapters (dropout, the rank-r matmuls, the scaled add into the base output) are bandwidth-bound, in many
# small kernels: the bytes they move at this share of the bandwidth (single-gpu-lora, 1B shape, H100 row).
ADAPTERS = 0.423
# bitsandbytes' 4-bit dequantisation before each matmul, at this share of the bandwidth (qlora, 1B shape, H100 row).
DEQUANTIZE = 0.0268
# DeepSpeed's CPU Adam, parameters a second (zero3-offload, 1B shape, H100 row, its step 3).
CPU_ADAM = 8.03e8
INTER_NODE = 50e9  # bytes/s a GPU gets between machines: 400 Gb/s InfiniBand, one NIC per GPU


class Planned(Protocol):
    """What the forecast reads of the planner's Estimate (bytes per process; trainable: all processes')."""

    @property
    def processes(self) -> int: ...
    @property
    def machines(self) -> int: ...
    @property
    def micro_batch(self) -> int: ...
    @property
    def seq_length(self) -> int: ...
    @property
    def attention(self) -> str: ...
    @property
    def gradients(self) -> int: ...
    @property
    def optimizer_state(self) -> int: ...
    @property
    def trainable(self) -> int: ...
    @property
    def stream_bytes(self) -> int: ...


@dataclass(frozen=True)
class Rates:
    """What the forecast divides by: the rates one process reaches at each kind of work."""
    name: str
    matmul: float  # FLOP/s
    attention: dict  # kernel -> FLOP/s of causal attention
    adapters: float  # bytes/s LoRA's small kernels move
    dequantize: float  # bytes/s
    bandwidth: float  # bytes/s of large elementwise work: the loss's, the optimizer step's
    host_link: float  # bytes/s one way
    interconnect: float  # bytes/s one way to another process of the same machine
    cpu_adam: float = CPU_ADAM  # parameters/s
    # seconds to dispatch one decoder layer's ops, and one LoRA adapter's, a pass (forward; backward counts 2):
    # what a CPU spends beside the arithmetic, the tiny model's whole step; a GPU's is in its efficiencies
    layer_dispatch: float = 0.0
    adapter_dispatch: float = 0.0
    recompute_dispatch: float = 0.0  # a checkpointed layer's recompute beyond a pass: torch.utils.checkpoint's own
    # a layer's step beyond full checkpointing's, by rung ("activation_offload": its hooks; "lean_norms": their
    # functions); and a tile of the tiled MLP's (its ops again a tile at a time), and an adapter's in it, a tile
    rung_dispatch: dict = field(default_factory=dict)
    tile_dispatch: float = 0.0
    tile_adapter_dispatch: float = 0.0
    model_dispatch: float = 0.0  # a micro batch's ops outside the layers (embedding, final norm, loss), all passes
    # elements/s LoRA's dropout draws, where drawing random numbers is a cost of its own (a CPU's bernoulli: a third
    # of the embedded single-gpu-lora step); 0: in the adapters' bytes, as a GPU's fused dropout is
    dropout: float = 0.0
    # torch's CPU flash kernel (sdpa on a CPU): it computes whole blocks of keys (cpu_flash_work), and beside its FLOPs
    # costs seconds per score it computes (the softmax's elementwise work) and per block, a forward and backward
    cpu_attention: bool = False
    attention_score: float = 0.0
    attention_block: float = 0.0
    # bytes/s the layers' elementwise ops move (norms, rotary, SwiGLU, residual adds, autocast's casts: a CPU's, each
    # tensor small enough to stay in its caches); 0: in MATMUL's efficiency, as on a GPU
    elementwise: float = 0.0


def gpu_rates(gpu: Gpu) -> Rates:
    """A GPU of the table at its datasheet peaks times the measured efficiencies."""
    return Rates(gpu.name, gpu.bf16_flops * MATMUL, {k: gpu.bf16_flops * e for k, e in ATTENTION.items()},
                 gpu.bandwidth * ADAPTERS, gpu.bandwidth * DEQUANTIZE, gpu.bandwidth, gpu.host_link, gpu.interconnect)


# The GPU a plan forecasts on when none is named (`--gpu NAME` names one).
REFERENCE = gpu_rates(GPUS["H100"])
# `plan --cpu`: the rates of this project's 2-core AVX2 machine, the median of six runs of `python benchmarks/forecast.py
# --cpu` (a CPU's own differ: that command prints them, and the ratio of forecast to measured on it).
CPU_RATES = Rates("this project's 2-core CPU", 3.91e11, {"sdpa": 2.42e11}, 2.32e10, 6.45e9, 6.45e9, 6.45e9, 6.45e9,
                  layer_dispatch=0.55e-3, adapter_dispatch=0.24e-3, recompute_dispatch=0.99e-3, model_dispatch=1.64e-3,
                  rung_dispatch={"activation_offload": 0.14e-3, "lean_norms": 0.31e-3}, tile_dispatch=0.47e-3,
                  tile_adapter_dispatch=0.61e-3, dropout=1.30e8, cpu_attention=True, attention_score=1.03e-9,
                  attention_block=50e-6, elementwise=2.51e10)
# An AMX CPU's (Intel Sapphire Rapids and later: torch's bf16 GEMMs are oneDNN's on its tiles, five times the matmul
# rate above), 2 cores, the median of four runs of the same command (2026-12-04).
AMX_RATES = Rates("this project's 2-core AMX CPU", 1.96e12, {"sdpa": 1.47e12}, 2.29e10, 8.8e9, 8.8e9, 8.8e9, 8.8e9,
                  layer_dispatch=0.375e-3, adapter_dispatch=0.19e-3, recompute_dispatch=1.145e-3,
                  model_dispatch=1.47e-3, rung_dispatch={"activation_offload": 0.03e-3, "lean_norms": 0.23e-3},
                  tile_dispatch=0.42e-3, tile_adapter_dispatch=0.505e-3, dropout=2.25e8, cpu_attention=True,
                  attention_score=1.01e-9, attention_block=38e-6, elementwise=2.13e10)


def cpu_rates(flags: frozenset[str]) -> Rates:
    """The rates a plan forecasts a run on this CPU at (`flags`: planning.hardware.cpu_flags): an AMX CPU's where it
    has AMX's bf16 tiles, else the AVX2 machine's (CPU_RATES; an AVX-512 CPU without AMX lies between the two)."""
    return AMX_RATES if "amx_bf16" in flags else CPU_RATES


@dataclass(frozen=True)
class Forecast:
    step_seconds: float  # one optimizer step, per process (all processes step together)
    tokens_per_second: float  # over all processes (a tensor-parallel group's tokens once)
    parts: dict  # seconds a step by kind of work, before overlap (what the step is made of)
    device: str  # what the rates are of


def _linear_params(s: Structure, mlp_only: bool = False) -> int:
    """The decoder layers' matmul parameters a token multiplies by (routed experts at top_k), or their MLPs' alone."""
    return sum(g.layers * (sum(lin.params for lin in g.linears if not mlp_only or g.in_mlp(lin))
                           + g.expert_params * g.top_k // max(g.experts, 1)) for g in s.groups())


def tiles_again(recipe: Recipe, recomputed: bool | None = None) -> bool:
    """Whether the tiled MLP runs one forward more than the layer's other ops: its backward recomputes it tile by
    tile, and the layer's recompute (or no checkpointing at all) runs it as well, except where the recompute leaves
    it out (Recipe.recompute_skips_tiles). `recomputed`: what a recorded run did (True: the code before the
    fifth lease, whose recompute always ran it); None: what the loop does now."""
    if recomputed is None:
        recomputed = not recipe.recompute_skips_tiles
    return recipe.tiled_mlp is not False and recomputed


def matmul_flops(recipe: Recipe, s: Structure, tiles_recomputed: bool | None = None) -> float:
    """Matmul FLOPs a trained token costs: the forward 2N, backward's input gradients 2N and, when the base trains,
    its weight gradients 2N; one more forward of each checkpointed layer (full checkpointing; selective keeps the
    matmuls' outputs), one more of each MLP under the tiled MLP where it runs again beside its tiles' recompute
    (tiles_again), one more of the head under the fused loss (its backward recomputes the logits). N: the parameters
    a token multiplies by (routed experts at top_k), the head included, the embedding lookup not."""
    layers, head = _linear_params(s), s.vocab * s.hidden
    passes = 2 + 2 + (2 if method(recipe) == "full" else 0)
    flops = passes * (layers + head)
    if recipe.recomputes:
        flops += 2 * layers
    if tiles_again(recipe, tiles_recomputed):
        flops += 2 * _linear_params(s, mlp_only=True)
    if recipe.fused_loss:
        flops += 2 * head
    return float(flops)


def attention_passes(recipe: Recipe) -> float:
    """Attention's passes a step in forwards: the forward, again under full checkpointing, and backward's five
    products to the forward's two (FlashAttention's: the scores again, then dV, dP, dQ, dK)."""
    return 1 + (1 if recipe.recomputes else 0) + 2.5


def attention_flops(recipe: Recipe, s: Structure, seq: int, computed: float = 0.5) -> float:
    """Attention's FLOPs a token costs at `seq` tokens a row: per layer a forward's two products over the keys it
    computes, `computed` of the [seq x seq] square (0.5: causal, each query the keys before it, as the GPU's
    FlashAttention kernels skip the blocks above the diagonal; 1: every score, under a mask), times
    attention_passes. A packed row's documents attend only within themselves: counted as one document of the row's
    length, an upper bound."""
    per_layer = 2 * 2 * computed * seq * s.heads * s.head_dim
    return float(s.layers * per_layer * attention_passes(recipe))


def cpu_call_work(queries: int, keys: int, causal: bool) -> tuple[int, int]:
    """The scores and (query block, key block) pairs one call of torch's CPU flash kernel computes: queries in
    blocks of cpu_query_block(queries), keys in blocks of CPU_KEY_BLOCK, each computed whole; a causal call (queries
    and keys from the same first position) computes every key block a query block reaches and masks the future keys
    in the last one rather than skipping them (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, forward and
    backward alike)."""
    q = cpu_query_block(queries)
    scores = pairs = 0
    for m in range(0, queries, q):
        rows = min(q, queries - m)
        blocks = -(-(min(m + rows, keys) if causal else keys) // CPU_KEY_BLOCK)
        scores += rows * min(keys, blocks * CPU_KEY_BLOCK)
        pairs += blocks
    return scores, pairs


def cpu_flash_work(seq: int, causal: bool = True) -> tuple[float, int]:
    """What torch's CPU flash kernel computes of one row's [seq x seq] scores a head, one call: the share of the
    square, and its (query block, key block) pairs (cpu_call_work; at 512 tokens or fewer, the whole square)."""
    scores, pairs = cpu_call_work(seq, seq, causal)
    return scores / seq**2, pairs


def cpu_band_work(seq: int, chunk: int, window: int) -> tuple[float, int]:
    """cpu_flash_work for a sliding-window layer in query chunks (training.query_chunks.BandedAttention): each chunk
    against the keys its window reaches, under the band's mask, so every block of the call is computed."""
    scores = pairs = 0
    for start in range(0, seq, chunk):
        call = cpu_call_work(min(chunk, seq - start), min(start + chunk, seq) - max(0, start - window + 1), False)
        scores, pairs = scores + call[0], pairs + call[1]
    return scores / seq**2, pairs


def cpu_chunks_work(seq: int, chunk: int) -> tuple[float, int, int]:
    """cpu_flash_work for a row in query chunks (training.query_chunks.QueryChunkedAttention on a CPU: CpuFlash), and
    its blocks forward and backward apart: forward, each chunk two calls, its own keys (causal) and the keys before
    them (whole); backward, a call for each chunk of keys up to its own (its own causal). Each call's query blocks
    are its chunk's (64 queries at a chunk of 256, where a whole row of 2,048 takes 256). Returns the share of the
    square, a forward's pairs and a backward's."""
    scores, forward, backward = 0, 0, 0
    for start in range(0, seq, chunk):
        rows = min(chunk, seq - start)
        own = cpu_call_work(rows, rows, True)
        before = cpu_call_work(rows, start, False) if start else (0, 0)
        scores += own[0] + before[0]
        forward += own[1] + before[1]
        backward += own[1] + start // chunk * cpu_call_work(rows, chunk, False)[1]  # (each key chunk before: whole)
    return scores / seq**2, forward, backward


def window_share(seq: int, window: int) -> float:
    """Of a row's [seq x seq] scores, the share a causal sliding window holds (each query its `window` keys at most):
    what flash-attn's and flex_attention's kernels compute of a sliding-window layer (the blocks outside the window
    skipped; and torch's, for query chunks on a GPU); 0.5, causal, where the row does not reach the window."""
    if not window or window >= seq:
        return 0.5
    return window / seq * (1 - window / (2 * seq))


def attention_seconds(recipe: Recipe, s: Structure, seq: int, rows: float, attention: str, rates: Rates,
                      forward_only: bool = False) -> float:
    """Seconds the attention of `rows` rows of `seq` tokens takes on one process, in bf16, each group of layers
    (Structure.groups: sliding-window layers apart) at what its kernel computes. Under a mask (a packed row's
    documents, or a sliding window the row reaches, under sdpa: attention.dense_mask) no kernel skips a block: every
    score is computed; flash-attn and flex_attention compute a sliding window's band alone (window_share). Eager
    multiplies the [S x S] scores as plain batched matmuls. On a CPU, sdpa is torch's flash kernel: its blocks
    (cpu_flash_work), and its seconds beside the FLOPs a score and a block, for the passes attention_passes
    counts. Under query_chunks a sliding window takes no mask (attention.mask_window): its band alone, on a GPU
    (flash's local attention) as flash-attn's, on a CPU each chunk's call under the band's mask (cpu_band_work); a
    row without a window, on a CPU, its chunks' calls forward and backward (cpu_chunks_work). `forward_only`: one
    forward pass alone (run dpo's reference)."""
    total, passes = 0.0, 1.0 if forward_only else attention_passes(recipe)
    of = passes / attention_passes(recipe)  # (attention_flops counts attention_passes)
    for g in s.groups():
        window = mask_window(recipe.query_chunks, g.window)
        masked = attention == "sdpa" and (recipe.packing or 0 < window <= seq)
        calls = chunked(recipe.query_chunks, attention, recipe.packing, recipe.per_device_train_batch_size, seq,
                        g.window)  # (a call's queries)
        banded = calls and 0 < g.window < seq
        if attention not in rates.attention:  # (eager)
            total += of * attention_flops(recipe, g, seq, 1.0) * rows * seq / rates.matmul
        elif not rates.cpu_attention:
            share = 1.0 if masked else window_share(seq, g.window) if banded or attention != "sdpa" else 0.5
            total += of * attention_flops(recipe, g, seq, share) * rows * seq / rates.attention[attention]
        else:
            if calls and not banded:
                share, forward, backward = cpu_chunks_work(seq, calls)
            else:
                share, forward = cpu_band_work(seq, calls, g.window) if banded else cpu_flash_work(
                    seq, causal=not masked)
                backward = forward
            # (in forwards: a backward is 2.5 of them)
            blocks = forward if forward_only else (passes - 2.5) * forward + 2.5 * backward
            beside = g.layers * g.heads * rows / 3.5 * (
                passes * share * seq**2 * rates.attention_score + blocks * rates.attention_block)
            total += of * attention_flops(recipe, g, seq, share) * rows * seq / rates.attention[attention] + beside
    return total


def dropout_draws(recipe: Recipe, s: Structure, tiles_recomputed: bool | None = None) -> float:
    """Random numbers LoRA's dropout draws a trained token: each adapter its input's width, in the forward, again in
    the layer's recompute (full or selective checkpointing: selective recomputes all but the matmuls; the tiled MLP's
    again where tiles_again), and once more in backward where the adapter's own checkpoint redraws its mask
    (training.adapters.recompute_dropout: not where peft's dropout is kept). Counted through a real step by
    tests/unit/planning/test_forecast.py."""
    if recipe.lora is None or not recipe.lora.dropout:
        return 0.0
    redraw, again = not recipe.keeps_dropout, tiles_again(recipe, tiles_recomputed)
    total = 0.0
    for g in s.groups():
        for lin in g.lora_linears(recipe.lora.target_modules):
            draws = 1 + (1 if recipe.checkpoints else 0) + (1 if again and g.in_mlp(lin) else 0) + (1 if redraw else 0)
            total += g.layers * lin.in_features * draws
    return total


def adapter_bytes(recipe: Recipe, s: Structure, tiles_recomputed: bool | None = None) -> float:
    """Bytes LoRA's adapters move a token, in 16 bits: forward, each adapted linear reads its input for A (and,
    with dropout, reads it and writes the dropped copy and its mask), writes B's output, scales it and adds it into
    the base output; backward about twice that; once more a recomputed forward."""
    if recipe.lora is None:
        return 0.0
    dropout, again = recipe.lora.dropout > 0, tiles_again(recipe, tiles_recomputed)
    total = 0.0
    for g in s.groups():
        for lin in g.lora_linears(recipe.lora.target_modules):
            passes = 3 + (1 if recipe.checkpoints else 0) + (1 if again and g.in_mlp(lin) else 0)
            total += g.layers * _adapter_forward(lin, dropout) * passes
    return total


def _adapter_forward(lin, dropout: bool) -> float:
    """Bytes an adapter's forward moves a token (adapter_bytes)."""
    return 2 * lin.in_features * (1 + (2.5 if dropout else 0)) + 2 * 6 * lin.out_features


def elementwise_bytes(recipe: Recipe, s: Structure, stream: int, compute: int = 2, forward_only: bool = False) -> float:
    """Bytes the elementwise ops between the matmuls move a trained token, a step (reads and writes, read off the
    ops transformers' Llama-family layers run under autocast; tests/unit/planning/test_forecast.py counts them op by
    op with a dispatch mode). A layer's forward, again where it is checkpointed (selective recomputes exactly these
    ops), and its backward; the final norm's forward and backward. Per element, in the residual stream's bytes `r`
    (`stream`: Estimate.stream_bytes) and the compute dtype's `c` (autocast's copy between them, where they differ,
    `r + c`):
    - an RMSNorm: its fp32 copy in and out (16-bit stream), the square, the mean's read, the scale, the weight's
      multiply; backward about three times that, and its weight's gradient where the norms train (a full fine-tune);
      a lean norm (training.norms) writes its output into a buffer, and its backward normalises again;
    - each linear that reads a norm's output casts it to `c` (and its gradient back) where the stream is fp32;
    - the two residual adds, and in backward one add per linear reading the stream (the input gradients' sums and
      the residual merges);
    - rotary on the query and key (its tables in the stream's dtype: the products promote to it), and the SwiGLU
      product over the intermediate width, again a tile at a time where the tiled MLP runs it again (tiles_again).
    Dense layers: a routed MoE's experts are counted at the layer's intermediate width, once. `forward_only`: one
    forward alone (run dpo's reference)."""
    r, c = stream, compute
    cast = r + c if r != c else 0
    trains, casts = recipe.lora is None, 12 if r == 2 else 0  # (a full fine-tune trains the norms)
    if recipe.lean_norms and s.lean_norms_apply:  # (training.norms: the same ops, written into buffers, and a
        # closed-form backward that computes the normalised input again)
        norm_f = 20 + 4 * r + casts
        norm_b = 56 + 3 * r + casts + (3 * r + 4 + casts if trains else 0)
    else:
        norm_f = 20 + 2 * r + casts
        norm_b = 68 + 2 * r + casts + (4 * r if trains else 0)
    total = s.hidden * (norm_f + (0 if forward_only else norm_b))  # (the final norm)
    for g in s.groups():
        qk, _ = g.qk_norms
        norms = g.hidden * (4 if g.model_type in SANDWICH_NORMED else 2) + qk
        reads = len(g.linears) - 2  # (o_proj reads attention's output, down_proj the SwiGLU product)
        rotated = (g.heads + g.kv_heads) * g.head_dim
        forward = (norms * norm_f + reads * g.hidden * cast + 2 * (2 * r + c) * g.hidden
                   + rotated * (5 * c + 5 * r + cast) + 5 * c * g.intermediate)
        backward = (norms * norm_b + reads * g.hidden * (cast + 3 * r) + rotated * (6 * r + 12 * c + 3 * cast)
                    + 9 * c * g.intermediate)
        again = 5 * c * g.intermediate if tiles_again(recipe) else 0
        total += g.layers * (forward if forward_only else forward * (2 if recipe.checkpoints else 1) + backward + again)
    return float(total)


def dispatch_seconds(recipe: Recipe, s: Structure, tokens: float, rates: Rates) -> float:
    """Seconds a micro batch's ops take to dispatch, where that is a cost of its own (a CPU's; a GPU's is in its
    efficiencies): the ops outside the layers, and a layer's each pass (forward, the recompute under checkpointing,
    backward's two) with its adapters', a checkpointed layer's recompute beyond a pass, and its rungs' own."""
    adapters = len(s.lora_linears(recipe.lora.target_modules)) if recipe.lora else 0
    passes = 3 + (1 if recipe.checkpoints else 0)
    layer = passes * (rates.layer_dispatch + adapters * rates.adapter_dispatch) + rung_seconds(recipe, s, tokens, rates)
    if recipe.checkpoints:
        layer += rates.recompute_dispatch
    return rates.model_dispatch + s.layers * layer


def rung_seconds(recipe: Recipe, s: Structure, tokens: float, rates: Rates) -> float:
    """Seconds a layer's rungs cost a micro batch to dispatch beyond full checkpointing's: the activation offload's
    hooks, the lean norms' functions, and the tiled MLP's ops run a tile at a time (forward, recompute, backward),
    where it runs more than one tile (training.tiling.tiled_forward: one tile is the plain MLP)."""
    seconds = sum(cost for rung, cost in rates.rung_dispatch.items() if getattr(recipe, rung))
    tiles = tile_count(recipe.tiled_mlp, int(tokens), s.hidden) if recipe.tiled_mlp is not False else 1
    if tiles > 1:
        adapters = sum(1 for lin in s.lora_linears(recipe.lora.target_modules) if s.in_mlp(lin)) if recipe.lora else 0
        seconds += tiles * (rates.tile_dispatch + adapters * rates.tile_adapter_dispatch)
    return seconds


def reference_seconds(recipe: Recipe, s: Structure, stream: int, seq: int, tokens: float, attention: str, rates: Rates,
                      slower: int) -> float:
    """Seconds run dpo's reference takes a micro batch, where it runs beside each one (Recipe.dpo_reference "copy",
    "adapter", "adapters-off"; recipes/dpo.py, Preference.reference): one forward under no_grad, the head's
    log-probabilities included: the matmuls' 2N, attention's forward, a saved adapter's frozen copy's adapters
    (none with the adapters off or for a frozen copy of the model), the loss's forward bytes, and where they are costs
    of their own (a CPU's) the elementwise ops and the dispatch of one pass (a third of a micro batch's ops
    outside the layers: its forward of three); its pass over the weights (dequantized, gathered, exchanged) is
    forecast's. A store of them ("store") is computed once before step 1, outside the step."""
    tp = recipe.tensor_parallel
    seconds = slower * 2 * (_linear_params(s) + s.vocab * s.hidden) * tokens / tp / rates.matmul
    seconds += slower * attention_seconds(recipe, s, seq, tokens / seq, attention, rates, forward_only=True) / tp
    seconds += s.vocab * LOSS_FORWARD_BYTES * tokens / tp / rates.bandwidth
    adapted = [(g, lin) for g in s.groups() for lin in g.lora_linears(recipe.lora.target_modules)] \
        if recipe.lora and recipe.dpo_reference == "adapter" else []
    seconds += sum(g.layers * _adapter_forward(lin, False) for g, lin in adapted) * tokens / rates.adapters
    if rates.elementwise:
        seconds += elementwise_bytes(recipe, s, stream, 2 * slower, forward_only=True) * tokens / rates.elementwise
    if rates.layer_dispatch or rates.model_dispatch:
        seconds += rates.model_dispatch / 3 + s.layers * rates.layer_dispatch \
            + sum(g.layers for g, _ in adapted) * rates.adapter_dispatch
    return seconds


# Bytes the loss moves a logit beyond its matmuls (training/loss.py HeadLoss; the unfused path holds the same steps):
# forward the bf16 logits written (2), cast to fp32 (2 read, 4 written), log-sum-exp's read (4); backward the logits
# again (2 + 6), the softmax's subtract and exp in place (8 + 8), the gradient's scale (8) and its cast to bf16 (6).
LOSS_BYTES = 2 + 6 + 4 + 8 + 8 + 8 + 8 + 6
LOSS_FORWARD_BYTES = 2 + 6 + 4  # (the forward's alone: run dpo's reference, no_grad)


def _beside(recipe: Recipe, s: Structure, est: Planned, rates: Rates, tokens: float, passes: int, link: float,
            sharded: bool) -> dict:
    """A micro batch's copies that run on another stream while the GPU computes, in seconds by kind."""
    processes, tp, beside = est.processes, recipe.tensor_parallel, {}
    if recipe.activation_offload:  # each layer's input to the host in forward, back in backward
        beside["offload"] = 2 * s.layers * tokens * s.hidden * 2 / rates.host_link
    weights16 = s.params * 2 / tp
    if sharded and processes > 1:
        share = (processes - 1) / processes
        beside["gathers"] = (weights16 * passes + weights16) * share / link  # and a reduce-scatter of the gradients
    elif processes > 1 and tp == 1:
        beside["all-reduce"] = 2 * (processes - 1) / processes * est.gradients \
            / recipe.gradient_accumulation_steps / link  # (once a step: spread over its micro batches)
    if recipe.deepspeed and recipe.deepspeed.offload_param != "none" or recipe.fsdp and recipe.fsdp.offload_params:
        beside["parameters from host"] = weights16 / processes * passes / rates.host_link
    return beside


def forecast(recipe: Recipe, s: Structure, est: Planned, rates: Rates, precision: str = "bf16",
             tiles_recomputed: bool | None = None) -> Forecast:
    """Seconds an optimizer step of the estimated run takes at these rates, per process: gradient_accumulation_steps micro
    batches, each its matmuls, attention, adapters and dequantisation one after the other, with the copies that run
    beside them (the activation offload's, the sharded engines' gathers) hidden behind them up to their length; then
    the optimizer step, its traffic from the estimate's gradients and optimizer state. In fp32 (`precision` "no")
    the matmuls run at half the rate (TF32's dense peak is half bf16's on these GPUs). `tiles_recomputed`: tiles_again's,
    for a recorded run."""
    processes, machines, attention = est.processes, est.machines, est.attention
    batch, seq = est.micro_batch, est.seq_length
    sp = recipe.sequence_group(processes) * recipe.context_parallel
    tokens = batch * seq / sp  # a micro batch's tokens on one process (sequence parallelism splits each row)
    tp = recipe.tensor_parallel
    slower = 1 if precision in ("bf16", "fp16") else 2
    mm = slower * matmul_flops(recipe, s, tiles_recomputed) * tokens / tp / rates.matmul
    attn = slower * attention_seconds(recipe, s, seq, tokens / seq, attention, rates) / tp
    drawn = recipe  # (where drawing is a cost of its own, the adapters' bytes are counted without their dropout's)
    if rates.dropout and recipe.lora and recipe.lora.dropout:
        drawn = replace(recipe, lora=replace(recipe.lora, dropout=0.0))
    parts = {"matmuls": mm, "attention": attn,
             "adapters": adapter_bytes(drawn, s, tiles_recomputed) * tokens / rates.adapters,
             "loss": s.vocab * LOSS_BYTES * tokens / tp / rates.bandwidth}
    if drawn is not recipe:
        parts["dropout"] = dropout_draws(recipe, s, tiles_recomputed) * tokens / rates.dropout
    if rates.elementwise:  # (norms and residual adds run whole on each tensor-parallel rank: counted whole)
        parts["elementwise"] = elementwise_bytes(recipe, s, est.stream_bytes, 2 * slower) * tokens / rates.elementwise
    if rates.layer_dispatch or rates.adapter_dispatch or rates.model_dispatch:
        parts["dispatch"] = dispatch_seconds(recipe, s, tokens, rates)
    reference = recipe.dpo_reference in ("copy", "adapter", "adapters-off")  # (run dpo's, beside each micro batch)
    if reference:
        parts["reference"] = reference_seconds(recipe, s, est.stream_bytes, seq, tokens, attention, rates, slower)
    # passes over the weights: the forward, its recompute, backward (and the reference's forward): each dequantizes,
    # gathers and exchanges
    passes = 2 + (1 if recipe.checkpoints else 0) + (1 if reference else 0)
    if recipe.quantization:  # 4-bit read, 16-bit written and read again, before every matmul of a frozen weight
        weights = sum(g.layers * sum(lin.params for lin in g.linears) for g in s.groups())
        parts["dequantize"] = weights * 4.5 * passes / rates.dequantize
    link = rates.interconnect if machines == 1 else min(rates.interconnect, INTER_NODE)
    sharded = bool(recipe.fsdp) or bool(recipe.deepspeed and recipe.deepspeed.zero_stage == 3)
    beside = _beside(recipe, s, est, rates, tokens, passes, link, sharded)
    if tp > 1:  # two all-reduces of a layer's output per pass, waited on
        parts["tensor all-reduce"] = 2 * passes * s.layers * tokens * s.hidden * 2 * 2 * (tp - 1) / tp / link
    u = recipe.sequence_group(processes)
    if u > 1:  # Ulysses: q, k, v in and the output out, each way
        width = 2 * s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim
        parts["all-to-all"] = passes * s.layers * tokens * width * 2 * (u - 1) / u / link
    micro = sum(parts.values())
    micro = max(micro, *beside.values()) if beside else micro
    trained = est.trainable / (processes if sharded or recipe.deepspeed else 1)  # (ZeRO-1/2 shard the step too)
    if recipe.deepspeed and recipe.deepspeed.offload_optimizer != "none":
        optimizer = trained / rates.cpu_adam + trained * (4 + 2) / rates.host_link  # gradients down, 16-bit weights up
    else:  # read and write the weights and the state, read the gradients
        optimizer = (2 * est.optimizer_state + est.gradients + 2 * trained * 4) / rates.bandwidth
    step = recipe.gradient_accumulation_steps * micro + optimizer
    parts = {k: v * recipe.gradient_accumulation_steps for k, v in (parts | beside).items()} | {"optimizer": optimizer}
    tokens_per_step = processes / tp * tokens * recipe.gradient_accumulation_steps  # (a TP group's once)
    return Forecast(step, tokens_per_step / step, parts, rates.name)
