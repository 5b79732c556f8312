"""How much memory a recipe needs, per process and per machine, before anything is launched.

Pure Python: Recipe x Structure (from config.json) x Topology -> Estimate. Every formula, with its
source and what it leaves out, is in docs/memory.md. Activations are counted the way PyTorch
saves tensors for backward in transformers' Llama-family layers (measured on CPU, see the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..errors import RecipeError
from ..units import GiB
from .architecture import Structure, Tensor, lora_tensors_on_meta
from .attention import dense_mask, flash_installed, pick_attention
from .optimizers import OPTIMIZERS
from .recipe import METHODS, Recipe, method
from .topology import Topology, check_supported, resolve_precision

GPU_OVERHEAD = 1 * GiB  # CUDA context, kernels, cuBLAS/NCCL workspaces, allocator slack
CPU_OVERHEAD = GiB // 2  # per process on CPU: torch, transformers, accelerate, DeepSpeed (measured RSS ~0.45 GiB)
BNB_MIN_8BIT = 4096  # bitsandbytes keeps 32-bit state for tensors smaller than this
BNB_BLOCK = 256  # ... and one float32 absmax per block of 256 per state, plus a 256-entry qmap per state
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "logits", "overhead")


@dataclass(frozen=True)
class Estimate:
    recipe: str
    processes: int
    machines: int
    micro_batch: int
    seq_length: int
    parameters: int  # bytes per process, on the device (GPU, or host RAM in CPU smoke-test mode)
    gradients: int
    optimizer_state: int
    activations: int
    logits: int  # logits and loss temporaries at the loss
    overhead: int
    host_offload: int  # bytes per machine of host RAM for offloaded state (pinned)
    cpu: bool
    speed_cost: float  # step time relative to bf16 full fine-tuning on one GPU
    saved_peak: int = 0  # peak bytes saved for backward (activations + the saved log-softmax)
    # activations and logits at their joint peak: with checkpointing the loss (start of backward) and a
    # layer's recompute (later) do not overlap, and the larger moment counts; without it, both at once
    working: int = 0
    # host RAM per machine while the model loads, before it is sharded or moved to the GPUs
    host_load: int = 0
    notes: tuple[str, ...] = field(default=())
    step: int = 0  # the optimizer step's temporaries beyond its state (in `working` when they are the peak)
    attention: str = "sdpa"  # the kernel planned: what `attn_implementation` resolves to (planning.attention)
    # of `parameters` and `gradients`: what exists only while a layer computes (FSDP's running and prefetched unit,
    # ZeRO-3's largest layer, gathered whole; a unit's full gradients before the reduce-scatter), resharded after it
    gathered_params: int = 0
    gathered_grads: int = 0

    @property
    def total(self) -> int:
        """Per process, on its device, at the step's peak."""
        return self.model_states + self.working + self.overhead

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    def host_total(self) -> int:
        """Host RAM one machine needs: offloaded state, plus the processes themselves on CPU; or, if
        more, what loading the model holds."""
        local = self.processes // self.machines
        return max(self.host_offload + (local * self.total if self.cpu else 0), self.host_load)

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("recipe", "processes", "machines", "micro_batch", "seq_length",
                                             *CATEGORIES, "host_offload", "host_load", "cpu", "speed_cost", "saved_peak",
                                             "working", "step", "attention", "gathered_params",
                                             "gathered_grads")}
        return out | {"total": self.total, "host_total": self.host_total(), "notes": list(self.notes)}


def adam_state_bytes(tensors: list[int], eight_bit: bool) -> int:
    """AdamW state: two fp32 moments (+ a step scalar) per tensor; bitsandbytes 8-bit: two uint8
    moments with a float32 absmax per 256-element block, for tensors of >= 4096 elements (smaller
    ones keep fp32 moments), plus two 256-entry quantisation maps shared by all tensors."""
    total = 0
    for n in tensors:
        if eight_bit and n >= BNB_MIN_8BIT:
            total += 2 * (n + 4 * math.ceil(n / BNB_BLOCK))
        else:
            total += 8 * n + (0 if eight_bit else 4)
    if eight_bit and any(n >= BNB_MIN_8BIT for n in tensors):
        total += 2 * 4 * 256
    return total


TORCHAO_BLOCK = 256  # torchao's AdamW8bit: one fp32 scale per block of 256, and a 256-entry fp32 map per state


def optimizer_state_bytes(recipe: Recipe, tensors: list[Tensor], weight_bytes: int) -> int:
    """The optimizer state of these trained tensors. AdamW keeps two moments per tensor in its dtype
    (fp32 masters: 4 bytes each; bf16 weights: 2) and a 4-byte step. bitsandbytes' 8-bit: adam_state_bytes,
    but embeddings keep fp32 moments (optimizers.EMBEDDING_BITS).
    torchao's 8-bit (adamw_torch_8bit): uint8 moments with an fp32 scale per 256-block and a map of their
    own, for tensors of >= 4096 elements that split into whole blocks; embeddings keep fp32 moments
    (optimizers.EMBEDDING_BITS); other tensors, moments in their dtype. APOLLO: a projected m x n matrix
    keeps its moments in rank x max(m, n) and the projection rank x min(m, n) (in its dtype), and a
    0-dim norm; the rest are AdamW's moments, with int steps."""
    state = OPTIMIZERS[recipe.optim].state
    if state == "bnb_8bit":  # embeddings: fp32 moments and an int step
        embeddings = sum(8 * t.numel for t in tensors if t.kind == "embedding")
        return embeddings + adam_state_bytes([t.numel for t in tensors if t.kind != "embedding"], eight_bit=True)
    total = 0
    if state == "torchao_8bit":
        for t in tensors:
            n = t.numel
            if t.kind == "embedding":
                total += 8 * n
            elif n >= BNB_MIN_8BIT and n % TORCHAO_BLOCK == 0:
                total += 2 * (n + 4 * n // TORCHAO_BLOCK + 4 * 256)
            else:
                total += 2 * weight_bytes * n
            total += 4
        return total
    if state == "low_rank":
        r, projected = recipe.optim_args.rank, set(projected_tensors(recipe, tensors))
        for i, t in enumerate(tensors):
            if i in projected:
                m, n = t.shape
                total += weight_bytes * (2 * r * max(m, n) + r * min(m, n) + 1)
            else:
                total += 2 * weight_bytes * t.numel
        return total
    return sum(2 * weight_bytes * t.numel + 4 for t in tensors)


def step_temporaries(recipe: Recipe, tensors: list[Tensor], weight_bytes: int) -> int:
    """Bytes an optimizer's step allocates beyond its state. APOLLO (apollo_torch/apollo.py, random_projector.py),
    gradients in the weights' dtype: a projected m x n matrix makes `scaled_grad` = its gradient x the channel
    scale, then divides it by the norm-growth limiter into a second full-size tensor (2 x m x n x the gradient's
    bytes), beside its projected gradient, `denom`, `norm_grad` and their norms (~4 x rank x max(m, n)); at a refresh
    (the first step, then every update_proj_gap) get_orthogonal_matrix first copies a 16-bit gradient to fp32 (4 x
    m x n, freed before). A tensor it does not project (embeddings, norms) makes AdamW's `denom` and `norm_grad`,
    each its size. One step over all tensors keeps the previous tensor's last update alive in the loop's locals
    while the next one's are made: its largest other tensor's size comes on top; with the step in backward each
    tensor steps alone. The other optimizers' steps are not counted yet (torch's foreach AdamW makes whole-list
    intermediates; bitsandbytes' and torchao's steps are fused kernels): docs/memory.md."""
    if OPTIMIZERS[recipe.optim].state != "low_rank":
        return 0
    projected, r, gb = set(projected_tensors(recipe, tensors)), recipe.optim_args.rank, weight_bytes
    each = []
    for i, t in enumerate(tensors):
        if i in projected:
            m, n = t.shape
            each.append(max(2 * t.numel * gb, 4 * t.numel if gb < 4 else 0) + 4 * r * max(m, n) * gb)
        else:
            each.append(2 * t.numel * gb)
    largest = max(range(len(tensors)), key=each.__getitem__)
    if recipe.optimizer_in_backward:
        return each[largest]
    return each[largest] + max((t.numel * gb for i, t in enumerate(tensors) if i != largest), default=0)


def projected_tensors(recipe: Recipe, tensors: list[Tensor]) -> list[int]:
    """Indices of the weights a low-rank optimizer projects (optimizers.projected_names: the linear weights
    optim_target_modules names, lm_head included under all-linear)."""
    targets = recipe.optim_target_modules
    return [i for i, t in enumerate(tensors) if t.kind == "linear" and (targets == "all-linear" or t.name in targets)]


def quantized_bytes(numel: int, rows: int, q) -> int:
    """One bitsandbytes-quantized weight with its scales. 8-bit: a byte per weight and an fp32 scale
    per row. 4-bit: two weights per byte and an absmax per block of 64 weights (fp32; with double
    quantization uint8, plus an fp32 absmax per 256 of those, an offset and its own copy of the
    256-entry fp32 map), and a 16-entry fp32 code."""
    return (numel if q.bits == 8 else math.ceil(numel / 2)) + quant_scale_bytes(numel, rows, q)


def quant_scale_bytes(numel: int, rows: int, q) -> int:
    """The scales and codes of one quantized weight (bitsandbytes' quant_state; quantized_bytes less the packed
    weights)."""
    if q.bits == 8:
        return 4 * rows
    blocks = math.ceil(numel / 64)
    return (blocks + 4 * math.ceil(blocks / 256) + 4 + 4 * 256 if q.double_quant else 4 * blocks) + 4 * 16


def quant_state_bytes(recipe: Recipe, s: Structure) -> int:
    """The quantized linears' scales and codes (bitsandbytes' quant_state), the whole model's."""
    q = recipe.quantization
    if q is None or not recipe.lora:
        return 0
    return sum(g.layers * sum(quant_scale_bytes(lin.in_features * lin.out_features, lin.out_features, q)
                              for lin in g.linears) for g in s.groups())


def base_bytes(recipe: Recipe, s: Structure, cb: int, layer_only: bool = False) -> int:
    """The frozen LoRA base (the whole model, or one decoder layer): in the compute dtype; or with
    quantization, the decoder layers' linears quantized and the rest (embeddings, head, norms, biases)
    in the 4-bit storage dtype, or in fp32 after PEFT's k-bit preparation (upcast_unquantized)."""
    q = recipe.quantization
    if q is None:
        return cb * (s.largest_layer_params if layer_only else s.params)
    # loaded in the float quant_storage dtype (uint8 storage: the compute dtype), or upcast by PEFT
    other = 4 if q.upcast_unquantized else {"bf16": 2, "fp16": 2, "fp32": 4}.get(q.quant_storage, cb)
    layers = [(g.layers, sum(quantized_bytes(lin.in_features * lin.out_features, lin.out_features, q)
                             + (other * lin.out_features if lin.bias else 0) for lin in g.linears)
               + other * sum(g.layer_norm_params)) for g in s.groups()]
    if layer_only:  # the largest layer
        return max(layer for _, layer in layers)
    return sum(n * layer for n, layer in layers) + other * sum(s.top_params)


def trainable_tensors(recipe: Recipe, s: Structure) -> list[Tensor]:
    """What trains: every tensor of a full fine-tune; with LoRA the adapters (A, B, DoRA's magnitude per
    output channel), the biases `bias` names, and a copy of each module of `modules_to_save`."""
    lora = recipe.lora
    if lora is None:
        return s.tensors()
    if s.experts:  # peft adapts fused experts and routers in shapes of its own: read them off peft
        return lora_tensors_on_meta(s.config, lora)
    adapters = []
    for g in s.groups():
        r, targets = lora.r, g.lora_linears(lora.target_modules)
        per_layer = [t for lin in targets for t in (Tensor("lora_A", (r, lin.in_features), "other"),
                                                    Tensor("lora_B", (lin.out_features, r), "other"))]
        if lora.use_dora:
            per_layer += [Tensor("lora_magnitude_vector", (lin.out_features,), "other") for lin in targets]
        biased = {"none": [], "all": g.linears, "lora_only": targets}[lora.bias]
        per_layer += [Tensor(lin.name, (lin.out_features,), "other") for lin in biased if lin.bias]
        adapters += per_layer * g.layers
    copies = []
    for name in lora.modules_to_save or ():
        matched = [t for t in s.tensors() if t.name == name]
        if name == "lm_head" and not matched:  # tied to the embeddings: peft copies the head, untied
            matched = [Tensor("lm_head", (s.vocab, s.hidden), "linear")]
        if not matched:
            raise RecipeError(f"lora.modules_to_save names {name!r}, which this {s.model_type} model has not "
                              "(e.g. embed_tokens, lm_head)")
        copies += matched
    return adapters + copies


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


def layer_activation_bytes(recipe: Recipe, s: Structure, mode: str, b: int, seq: int, attention: str) -> int:
    """Bytes one decoder layer saves for backward (Korthikanti et al. 2022's counting, redone for
    what transformers' Llama layers and PyTorch autograd really keep; docs/memory.md). `s`: the layer's group
    (Structure.groups); `attention`: the kernel that runs (planning.attention.pick_attention)."""
    h, kv, i, a, T = s.hidden, s.kv_dim, s.intermediate, s.heads, b * seq
    gated = s.gated_mlp
    moe = s.experts > 0  # the MLP is routed experts, counted below
    mlp = 0 if moe else (4 if gated else 2) * i  # gated: gate, act, up, act*up; plain: fc1 out, act out
    q_reads = 3 if any(lin.name == "q_proj" for lin in s.linears) else 1  # separate q/k/v casts
    up_reads = 2 if gated and any(lin.name == "up_proj" for lin in s.linears) else 1
    if mode == "fp32":
        per_token = 4 * (8 * h + 2 * kv + mlp)
    elif mode == "mixed":  # fp32 residual and norms; each linear saves its own bf16 cast of its input
        per_token = 4 * h * 4 + 2 * h * (q_reads + up_reads) + 2 * (2 * h + 2 * kv) + 2 * mlp
    else:  # half weights: norms upcast to fp32 (saved), the rest in 16-bit
        per_token = 20 * h + 4 * kv + 2 * mlp
        if mode in ("lora", "qlora"):
            lora = recipe.lora
            targets = s.lora_linears(lora.target_modules)
            per_token -= 8 * h + (2 * i if gated and not moe else 0)  # frozen linears and norms no longer keep their inputs
            # each adapter: the bf16 cast of its input, its rank-r output, and with dropout the fp32 noise mask
            per_token += sum(2 * lin.in_features + 2 * lora.r + (4 * lin.in_features if lora.dropout else 0)
                             for lin in targets)
        if mode == "qlora":
            per_token += 33 * h // 2  # the fp32 residual stream and norms (measured, Llama + bnb 4-bit)
    per_token += 8 + 4 * a  # two fp32 rsqrt vectors, SDPA's log-sum-exp per head
    if moe:  # top-k routing over transformers 5's fused experts (its batched kernels, measured): per routed
        # token the expert's gate/up output, activation and product (4 x intermediate) and its gathered input and
        # output (2 x hidden), in the experts' weight dtype (autocast does not cast them), three int64 indices
        # and two fp32 weights; per token the router's fp32 probabilities and int64 top-k indices
        eb = 4 if mode in ("fp32", "mixed") else 2
        per_token += s.top_k * (eb * (4 * i + 2 * h) + 32) + 4 * s.experts + 8 * s.top_k
    total = T * per_token
    cb = 4 if mode == "fp32" else 2  # the attention's compute dtype
    repeated = T * (a * s.head_dim - kv) * 2 * cb  # K and V copied to every query head (transformers' repeat_kv)
    if attention == "eager":  # the s x s scores: fp32 softmax (+ its 16-bit copy), k/v repeated, no log-sum-exp
        total += b * a * seq * seq * (4 if mode == "fp32" else 6) + repeated - T * 4 * a
    elif dense_mask(attention, recipe.packing, b):  # sdpa under a mask: K/V repeated, the mask made additive
        total += repeated + b * seq * seq * cb
    if mode == "mixed":
        total += 2 * sum(lin.params for lin in s.linears)  # autocast's bf16 weight copies, saved for backward
    if mode in ("lora", "qlora"):  # ... and of the fp32 adapters
        total += 2 * sum(recipe.lora.r * (lin.in_features + lin.out_features) for lin in targets)
        on_experts = [t for t in trainable_tensors(recipe, s) if ".experts." in t.name and f".layers.{s.first}." in t.name]
        if moe and on_experts:  # peft's ParamWrapper runs the experts on W + BA: that merged weight is saved, in
            total += 2 * s.expert_params + 2 * sum(t.numel for t in on_experts)  # 16 bits, with its factors' casts
    return total


def activation_bytes(recipe: Recipe, s: Structure, mode: str, b: int, seq: int, attention: str | None = None) -> dict:
    """One micro batch on one process: `activations` and `logits` (the categories), `saved_peak` (most
    bytes held for backward at once), `forward_saved` (held when the forward ends), `layer` (one layer's),
    `host` (checkpointed inputs moved to host memory by activation_offload). `attention`: the kernel that runs
    (planning.attention.pick_attention; None: what runs on CPU)."""
    h, V, T, d = s.hidden, s.vocab, b * seq, s.head_dim
    if attention is None:  # the kernel on CPU (what the tests measure)
        attention = pick_attention(recipe.attn_implementation, cuda=False, half=mode != "fp32", packing=recipe.packing,
                            flash=False, flex=False).name
    # tensor parallelism splits each layer's attention and MLP over tp_size processes (counted as if the
    # norms were split too: optimistic by ~10 bytes x hidden per token and layer); inputs stay whole
    tp = recipe.parallelism.tp_size if recipe.parallelism else 1
    layers = [(g.layers, layer_activation_bytes(recipe, g, mode, b, seq, attention) // tp) for g in s.groups()]
    layer = max(one for _, one in layers)  # the largest layer's (one is recomputed at a time)
    every_layer = sum(n * one for n, one in layers)
    host = 0
    residual = 2 if mode in ("half", "lora") else 4
    rope = T * 2 * d * (4 if mode in ("fp32", "mixed", "qlora") else 2)
    norm = T * ({"fp32": 12, "mixed": 10, "half": 8, "lora": 4, "qlora": 10}[mode] * h + 4)
    if recipe.fused_loss:  # the head's matmul no longer keeps its input (the chunks keep the targets' own)
        norm -= T * h * {"fp32": 4, "mixed": 2, "half": 2, "lora": 0, "qlora": 2}[mode]
    head_copy = 2 * V * h if mode in ("mixed", "qlora") else 0  # lm_head's bf16 weight copy (autocast)
    small = T * 8 + rope  # input ids, rotary cos/sin
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
    if recipe.gradient_checkpointing or (recipe.fsdp and recipe.fsdp.activation_checkpointing):
        inputs = s.layers * T * h * residual  # each layer keeps only its input; one layer is recomputed at a time
        if recipe.activation_offload:  # ... in host memory; on the device the one its layer's recompute uses and
            host, inputs = inputs, 2 * T * h * residual  # the next, prefetched (layers.HostOffload)
        forward_saved = inputs + small + norm + head_copy + saved_logits
        saved_peak = max(forward_saved, inputs + small + layer)  # the loss's tensors are gone by the recompute
        acts = inputs + small + max(layer, norm + head_copy)
        working = max(inputs + small + norm + head_copy + logits, inputs + small + layer)  # loss, or a recompute
    else:
        acts = every_layer + small + norm + head_copy
        forward_saved = saved_peak = acts + saved_logits
        working = acts + logits  # every layer's activations are still held at the loss
    return {"activations": acts, "logits": logits, "saved_peak": saved_peak, "forward_saved": forward_saved,
            "layer": layer, "host": host, "working": working}


def loading_bytes(recipe: Recipe, s: Structure, cb: int, local: int) -> int:
    """Host RAM per machine while the model loads. Every process reads the whole model into host memory
    before FSDP shards it or accelerate moves it to the GPU (transformers 5.x loads real weights on every
    rank), but under FSDP2 with cpu_ram_efficient_loading, where rank 0 alone loads them and broadcasts them
    as shards. Weights converted as they load (fp32 masters from a 16-bit checkpoint, 4-bit quantization)
    are each process's private copy; a 16-bit frozen base stays mapped from the checkpoint, one copy per
    machine. Under FSDP2 accelerate upcasts trainable weights to fp32 on every rank before sharding
    (accelerate/utils/fsdp_utils.py, fsdp2_prepare_model), so loading in bf16 would not save the copies.
    ZeRO-2 counts its copy with its model states; ZeRO-3 builds the model partitioned (zero.Init)."""
    if recipe.deepspeed is not None:
        return 0
    if recipe.quantization is not None:
        return base_bytes(recipe, s, cb) * local
    if recipe.lora is not None:
        return cb * s.params
    if rank0_loads(recipe):  # the other processes build the model without weights and receive rank 0's as shards
        return weight_bytes(recipe) * s.params
    return weight_bytes(recipe) * s.params * local  # (tensor parallelism too: each rank loads all, keeps its slices)


def rank0_loads(recipe: Recipe) -> bool:
    """FSDP2 with cpu_ram_efficient_loading: rank 0 alone loads the weights (loading.rank0_loads, the loop's side of
    the same rule; the generated config turns it on wherever FSDP2 runs, CPU included)."""
    return recipe.fsdp is not None and recipe.fsdp.version == 2 and recipe.fsdp.cpu_ram_efficient_loading


def weight_bytes(recipe: Recipe) -> int:
    """Bytes per trained weight: fp32 masters, or bf16 weights with no master copy (weight_dtype)."""
    return 2 if recipe.weight_dtype == "bf16" else 4


def speed_cost(recipe: Recipe, precision: str) -> float:
    """Rough step time relative to bf16 full fine-tuning on one GPU (docs/memory.md: rules of thumb)."""
    cost = 0.7 if recipe.lora else 1.0  # no weight gradients for the frozen base: ~4N instead of 6N FLOPs
    if recipe.gradient_checkpointing or (recipe.fsdp and recipe.fsdp.activation_checkpointing):
        cost *= 1.33  # one more forward
    if recipe.activation_offload:
        cost *= 1.15  # a copy to the host and back per layer, partly hidden behind compute
    if recipe.fsdp or (recipe.deepspeed and recipe.deepspeed.zero_stage == 3):
        cost *= 1.1  # gathers per layer, partly overlapped
    if recipe.fsdp and recipe.fsdp.offload_params:
        cost *= 3.0
    if recipe.deepspeed:
        cost *= (1.5 if recipe.deepspeed.offload_optimizer != "none" else 1.0)
        cost *= (2.0 if recipe.deepspeed.offload_param != "none" else 1.0)
    if recipe.parallelism:
        cost *= 1.15  # all-reduces of activations in every layer's forward and backward
    cost *= OPTIMIZERS[recipe.optim].step_cost  # 8-bit (de)quantisation of the state, or APOLLO's projections
    if recipe.quantization:
        cost *= 1.2  # each weight dequantised per matmul, forward and backward
    if precision == "no":
        cost *= 2.0  # no tensor-core bf16/fp16
    return round(cost, 2)


@dataclass
class States:
    """Model states per process for one engine (bytes), what of them a layer gathers while it computes, and the host
    RAM per machine they put there: what `estimate` adds activations and the rest to."""
    params: int
    grads: int
    optimizer: int
    host: int = 0
    gathered_params: int = 0
    gathered_grads: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Sizes:
    """The figures every engine's count reads: the model, what trains, the topology's shares."""
    params: int  # the model's parameters
    trained: int  # trainable parameters (all of them, or the adapters)
    compute_bytes: int  # 2 in bf16/fp16, 4 in fp32
    weight_bytes: int  # bytes per trained weight (fp32 masters, bf16 weights, LoRA's fp32 adapters)
    optimizer: int  # the optimizer's state, whole
    processes: int
    machines: int

    @property
    def local(self) -> int:
        return self.processes // self.machines


def zero3_states(recipe: Recipe, s: Structure, z: Sizes) -> States:
    """DeepSpeed's own accounting (estimate_zero3_model_states_mem_needs): 16-bit params and grads of the largest
    layer gathered on the GPU; 2 bytes/param of 16-bit weights, 16 of fp32 state per trained param (master, two
    moments, fp32 grad) partitioned, or offloaded to host RAM."""
    ds, layer, n = recipe.deepspeed, s.largest_module, z.processes
    out = States(2 * layer, 2 * layer, 0, gathered_params=2 * layer, gathered_grads=2 * layer,
                 notes=["ZeRO-3 model states follow DeepSpeed's estimate_zero3_model_states_mem_needs"])
    if ds.offload_param != "none":
        out.host = (16 * z.trained + 2 * z.params) // z.machines  # = 18 P when everything trains
    elif ds.offload_optimizer != "none":
        out.params += 2 * z.params // n
        out.host = 16 * z.trained // z.machines
    else:
        out.params, out.grads, out.optimizer = out.params + 2 * z.params // n, out.grads + 4 * z.trained // n, \
            12 * z.trained // n
        if ds.zero3_init:
            out.host = 4 * layer * z.local  # zero.Init materialises one layer at a time per process
    return out


def zero2_states(recipe: Recipe, z: Sizes) -> States:
    """ZeRO-1/2, DeepSpeed's own accounting (estimate_zero2_model_states_mem_needs): 16-bit weights replicated;
    16-bit and fp32 gradients, fp32 master weights and moments partitioned, or, with optimizer offload, all of that
    in host RAM; loading puts a full fp32 copy per process on the host."""
    notes = ["ZeRO-1/2 model states follow DeepSpeed's estimate_zero2_model_states_mem_needs"]
    if recipe.deepspeed.offload_optimizer != "none":
        return States(2 * z.params, 0, 0, max(4 * z.params * z.local, 16 * z.trained // z.machines), notes=notes)
    n = z.processes
    return States(2 * z.params, 6 * z.trained // n, 12 * z.trained // n, 4 * z.params * z.local, notes=notes)


def fsdp_states(recipe: Recipe, s: Structure, z: Sizes) -> States:
    """FSDP's shards, the units it gathers (the running one and the prefetched one, or all of it without
    resharding), a full unit's gradients before the reduce-scatter; with parameter offload, the shards on the host."""
    f, n, cb = recipe.fsdp, z.processes, z.compute_bytes
    tp = recipe.parallelism.tp_size if recipe.parallelism else 1
    # one decoder layer, or the root (embeddings, head); under TP, FSDP gathers a unit's TP shard only
    unit = max(s.largest_layer_params, s.root_params) // tp
    # the shards: trained params in fp32, a frozen LoRA base in the compute dtype (or quantized)
    base = base_bytes(recipe, s, cb) if recipe.lora else 0
    # a quantized base's scales are no part of FSDP's flat parameters: FSDP1 moves each parameter to the GPU
    # (bitsandbytes' Params4bit.to moves its quant_state there, in place) and shards or offloads only the
    # flat parameter, so every GPU keeps the whole model's absmax, nested absmax and codes
    scales = quant_state_bytes(recipe, s)
    sharded = (base - scales + 4 * (z.trained if recipe.lora else z.params)) // n
    unit_bytes = max(base_bytes(recipe, s, cb, layer_only=True), cb * s.root_params) if recipe.quantization \
        else cb * unit
    units = 2 * unit_bytes if f.reshard_after_forward else (base or cb * z.params // tp)
    unit_grads = 0 if recipe.lora else cb * unit  # a full unit's gradients before the reduce-scatter
    if f.offload_params:
        out = States(units + scales, unit_grads, 0, (sharded + 4 * z.trained // n + z.optimizer // n) * z.local)
    else:
        out = States(sharded + units + scales, 4 * z.trained // n + unit_grads, z.optimizer // n)
    out.gathered_params, out.gathered_grads = units, unit_grads
    if scales:
        out.notes.append(f"each GPU keeps the whole base's quantization scales ({scales / GiB:.2f} GiB): FSDP shards "
                         "only the packed weights")
    return out


def plain_states(recipe: Recipe, s: Structure, z: Sizes, train: list[Tensor]) -> States:
    """One process, or DDP: the whole model, its trainable gradients (twice under DDP: its buckets), the state."""
    grads = z.weight_bytes * z.trained
    if recipe.optimizer_in_backward:  # each gradient is freed by its parameter's update: one at a time
        grads = z.weight_bytes * max(t.numel for t in train)
    elif z.processes > 1:
        grads += z.weight_bytes * z.trained  # DDP's gradient buckets: a second copy of the trainable gradients
    base = base_bytes(recipe, s, z.compute_bytes) if recipe.lora else 0
    return States(base + z.weight_bytes * z.trained, grads, z.optimizer)


def add_reference(recipe: Recipe, z: Sizes, states: States) -> None:
    """DPO's reference, where it is a second copy: of the initial model (loaded as the policy is; sharded under
    FSDP, partitioned under ZeRO-3 in the engine's compute dtype and offloaded with the policy's parameters), or
    of a saved adapter (fp32, as loaded) beside the one that trains."""
    zero3 = recipe.deepspeed is not None and recipe.deepspeed.zero_stage == 3
    n = z.processes
    if recipe.dpo_reference == "copy":
        offloaded = zero3 and recipe.deepspeed.offload_param != "none"
        copy = z.compute_bytes * z.params // n if zero3 else z.weight_bytes * z.params // (n if recipe.fsdp else 1)
        if offloaded:
            states.host += copy * z.local
        else:
            states.params += copy
        states.notes.append(f"the reference: a frozen copy of the model ({copy / GiB:.2f} GiB per process"
                            + (", in host memory)" if offloaded else ")"))
    if recipe.lora and recipe.lora.adapter and recipe.dpo and not recipe.dpo.reference_free:  # (store or not)
        states.params += 4 * z.trained // (n if recipe.fsdp or zero3 else 1)
        states.notes.append(f"the reference: the saved adapter's frozen copy ({4 * z.trained / 2**20:,.1f} MiB), no "
                            "second model")


def engine_states(recipe: Recipe, s: Structure, z: Sizes, train: list[Tensor]) -> States:
    if recipe.deepspeed is not None:
        return zero3_states(recipe, s, z) if recipe.deepspeed.zero_stage == 3 else zero2_states(recipe, z)
    if recipe.fsdp:
        return fsdp_states(recipe, s, z)
    return plain_states(recipe, s, z, train)


def estimate(recipe: Recipe, s: Structure, topo: Topology, micro_batch: int | None = None,
             seq_length: int | None = None) -> Estimate:
    """Memory per process and per machine for this recipe, model and topology."""
    if s.experts and recipe.quantization is not None:
        share = sum(g.layers * g.expert_params for g in s.groups()) / s.params
        raise RecipeError(f"QLoRA saves little on {s.model_type}, whose experts ({share:.0%} of its parameters) are fused "
                          "tensors that stay in 16 bits (bitsandbytes quantizes nn.Linear layers only): use a LoRA "
                          "recipe (single-gpu-lora, fsdp-lora), with lora.dropout=0")
    batch, seq = micro_batch or recipe.per_device_train_batch_size, seq_length or recipe.max_seq_length
    precision = resolve_precision(recipe, topo)
    compute_bytes = 2 if precision in ("bf16", "fp16") else 4
    train = trainable_tensors(recipe, s)
    trained = sum(t.numel for t in train)
    weights = weight_bytes(recipe) if recipe.lora is None else 4  # LoRA's adapters train in fp32
    z = Sizes(s.params, trained, compute_bytes, weights, optimizer_state_bytes(recipe, train, weights),
              topo.num_processes, topo.num_machines)
    states = engine_states(recipe, s, z, train)
    add_reference(recipe, z, states)
    notes = states.notes
    load = loading_bytes(recipe, s, compute_bytes, z.local)
    if load and not topo.cpu:
        notes.append(f"loading holds {load / GiB:.1f} GiB of host RAM per machine before the model is on the GPUs")
    # the kernel a launch here would run: with flash-attn installed here, its varlen kernel; on a GPU without it,
    # flex_attention over packed rows (planning.attention)
    attention = pick_attention(recipe.attn_implementation, cuda=not topo.cpu, half=compute_bytes == 2,
                        packing=recipe.packing, flash=flash_installed(), flex=True)
    if attention.name != recipe.attn_implementation:
        notes.append(f"attention: {attention.name} ({attention.why})")
    act = activation_bytes(recipe, s, activation_mode(recipe, compute_bytes), batch, seq, attention.name)
    step = step_temporaries(recipe, train, weights)
    # the step's temporaries: after backward (the activations gone), or inside it, beside the checkpointed inputs
    working = max(act["working"], step + (act["forward_saved"] if recipe.optimizer_in_backward else 0))
    if step:
        notes.append(f"the optimizer's step allocates {step / GiB:.1f} GiB of temporaries at its largest tensor")
    if act["host"]:
        states.host += act["host"] * z.local
        notes.append("activation offload: each layer's checkpointed input waits in host memory")
    if topo.cpu:
        notes.append("CPU smoke-test mode: every figure is host RAM")
    return Estimate(
        recipe=recipe.name, processes=z.processes, machines=z.machines, micro_batch=batch, seq_length=seq,
        parameters=int(states.params), gradients=int(states.grads), optimizer_state=int(states.optimizer),
        activations=int(act["activations"]), logits=int(act["logits"]),
        overhead=CPU_OVERHEAD if topo.cpu else GPU_OVERHEAD, host_offload=int(states.host), cpu=topo.cpu,
        speed_cost=speed_cost(recipe, precision), saved_peak=int(act["saved_peak"]), working=int(working),
        host_load=int(load), notes=tuple(notes), step=int(step), attention=attention.name,
        gathered_params=int(states.gathered_params), gathered_grads=int(states.gathered_grads))


@dataclass(frozen=True)
class Verdict:
    estimate: Estimate
    device_capacity: int | None  # bytes per process (GPU memory; None in CPU mode)
    host_capacity: int | None  # bytes per machine

    @property
    def device_fits(self) -> bool:
        return self.device_capacity is None or self.estimate.total <= self.device_capacity

    @property
    def host_fits(self) -> bool:
        return self.host_capacity is None or self.estimate.host_total() <= self.host_capacity

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits

    @property
    def headroom(self) -> int | None:
        """Spare bytes on the tightest of device and host."""
        spare = []
        if self.device_capacity is not None:
            spare.append(self.device_capacity - self.estimate.total)
        if self.host_capacity is not None:
            spare.append(self.host_capacity - self.estimate.host_total())
        return min(spare) if spare else None

    @property
    def binding(self) -> str | None:
        """The tightest resource, "GPU" or "host" (None when neither is known)."""
        spare = {"GPU": None if self.device_capacity is None else self.device_capacity - self.estimate.total,
                 "host": None if self.host_capacity is None else self.host_capacity - self.estimate.host_total()}
        known = {name: bytes_ for name, bytes_ in spare.items() if bytes_ is not None}
        return min(known, key=known.get) if known else None


def judge(est: Estimate, gpu_memory: int | None, host_memory: int | None) -> Verdict:
    return Verdict(est, None if est.cpu else gpu_memory, host_memory)


def largest_micro_batch(recipe: Recipe, s: Structure, topo: Topology, gpu_memory, host_memory, limit: int) -> int:
    """The largest micro batch <= limit that fits (0 if not even 1 does)."""
    best = 0
    for b in range(1, limit + 1):  # memory grows with b: stop at the first that does not fit
        if not judge(estimate(recipe, s, topo, micro_batch=b), gpu_memory, host_memory).fits:
            break
        best = b
    return best


def batch_for(global_batch: int, micro_fit: int, processes: int) -> tuple[int, int] | None:
    """(micro batch, accumulation) reaching global_batch exactly, with the largest micro batch that fits."""
    per_process, rest = divmod(global_batch, processes)
    if rest:
        return None
    for micro in range(min(micro_fit, per_process), 0, -1):
        if per_process % micro == 0:
            return micro, per_process // micro
    return None


def with_batch(recipe: Recipe, micro: int, accumulation: int) -> Recipe:
    return replace(recipe, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation)


def recommend(verdicts: list[Verdict]) -> tuple[Verdict | None, str]:
    """The cheapest recipe that fits (the tuning flow: plain -> checkpointing -> sharding -> offload),
    and why, with the host RAM it needs; or, if none fits, what binds (the GPUs, or the host RAM of those
    the GPUs would hold), what comes closest and the remedy for that."""
    fitting = sorted((v for v in verdicts if v.fits), key=lambda v: (v.estimate.speed_cost, -(v.headroom or 0)))
    if fitting:
        best = fitting[0]
        e = best.estimate
        where = "per CPU process" if e.cpu else "per GPU"
        spare = f", {best.headroom / GiB:.1f} GiB to spare" if best.headroom is not None else ""
        host = ("" if e.cpu else f"; host RAM {e.host_total() / GiB:.1f} GiB per machine"
                + ("" if best.host_capacity is not None else " (not checked: give --host-memory)"))
        return best, (f"{e.recipe}: the fastest recipe that fits (step time x{e.speed_cost} of plain bf16), "
                      f"{e.total / GiB:.1f} GiB {where}{spare}{host}")
    if not verdicts:
        return None, "no recipe runs on this topology"
    on_device = [v for v in verdicts if v.device_fits]
    if on_device:  # the GPUs would hold these: the host RAM is what binds
        least = min(on_device, key=lambda v: v.estimate.host_total())
        return None, (f"nothing fits in host RAM: the least is {least.estimate.recipe} at "
                      f"{least.estimate.host_total() / GiB:.1f} GiB per machine, more than "
                      f"{least.host_capacity / GiB:.1f}; give the machines more host RAM, use more machines (each "
                      "holds its own processes' share), or train another way (LoRA, QLoRA)")
    least = min(verdicts, key=lambda v: v.estimate.total)
    return None, (f"nothing fits on the GPUs: the least is {least.estimate.recipe} at {least.estimate.total / GiB:.1f} "
                  "GiB per process; use more GPUs, a shorter max_seq_length, or per_device_train_batch_size=1")


def recommend_by_method(recipes: list[Recipe], verdicts: list[Verdict]) -> dict[str, tuple[Verdict | None, str]]:
    """recommend() within each training method that has a recipe here: {method: (verdict, why)}."""
    groups: dict[str, list[Verdict]] = {}
    for r, v in zip(recipes, verdicts):
        groups.setdefault(method(r), []).append(v)
    return {m: recommend(groups[m]) for m in METHODS if m in groups}


def breakdown(est: Estimate) -> str:
    """'params 29.9 + grads 29.9 + ... GiB' in one line."""
    short = {"parameters": "params", "gradients": "grads", "optimizer_state": "optimizer", "activations": "activations",
             "logits": "logits", "overhead": "overhead"}
    return " + ".join(f"{short[c]} {getattr(est, c) / GiB:.1f}" for c in CATEGORIES) + " GiB"


def judge_each(recipes: list[Recipe], shapes: dict, topo: Topology, gpu_memory: int | None, host_memory: int | None,
               global_batch: int | None = None) -> tuple[list[tuple[Recipe, Verdict, str]], list[tuple[str, str]]]:
    """Every recipe planned on this topology and judged against these memories (`plan`, and a refused run's
    pick of what would fit instead): ([(recipe, verdict, batch note)], [(recipe name, why it cannot be
    planned)]). `shapes`: model_name_or_path -> Structure. With `global_batch`, each recipe at the largest
    micro batch that fits, with the accumulation that makes up the global batch."""
    rows, skipped = [], []
    n = topo.num_processes
    for r in recipes:
        s, note = shapes[r.model_name_or_path], ""
        try:
            check_supported(r, topo)
            if global_batch:
                fit = largest_micro_batch(r, s, topo, gpu_memory, host_memory, max(1, global_batch // n))
                pair = batch_for(global_batch, fit, n) if fit else None
                if pair:
                    r, note = with_batch(r, *pair), f"{pair[0]} x {pair[1]}"
                else:
                    note = "none fits" if not fit else f"{global_batch} not divisible"
            rows.append((r, judge(estimate(r, s, topo), gpu_memory, host_memory), note))
        except RecipeError as e:  # a topology it does not support, or a model it cannot train (with the reason)
            skipped.append((r.name, str(e)))
    return rows, skipped
