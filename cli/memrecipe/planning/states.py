"""Model states per process, for one engine (one process or DDP, FSDP, ZeRO-1/2, ZeRO-3): parameters, gradients,
optimizer state (8-bit, low-rank, paged), what a layer gathers while it computes, host RAM for offload and for
loading, and DPO's second copy where there is one. The numbers estimate adds activations to (docs/memory.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import PINNED_CACHE_MB
from ..errors import RecipeError
from ..units import GiB
from .architecture import Structure, Tensor, lora_tensors_on_meta
from .optimizers import OPTIMIZERS
from .recipe import Recipe

BNB_MIN_8BIT = 4096  # bitsandbytes keeps 32-bit state for tensors smaller than this
BNB_BLOCK = 256  # ... and one float32 absmax per block of 256 per state, plus a 256-entry qmap per state


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
        return lora_tensors_on_meta(s.config or {}, lora)
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


def loading_bytes(recipe: Recipe, s: Structure, cb: int, local: int) -> int:
    """Host RAM per machine while the model loads. Every process reads the whole model into host memory
    before FSDP shards it or accelerate moves it to the GPU (transformers 5.x loads real weights on every
    rank), but under FSDP2 with cpu_ram_efficient_loading, where rank 0 alone loads them and broadcasts them
    as shards. Weights converted as they load (fp32 masters from a 16-bit checkpoint, 4-bit quantization)
    are each process's private copy; a 16-bit frozen base stays mapped from the checkpoint, one copy per
    machine. Under FSDP2 accelerate upcasts trainable weights to fp32 on every rank before sharding
    (accelerate/utils/fsdp_utils.py, fsdp2_prepare_model), so loading in bf16 would not save the copies.
    ZeRO-2 counts its copy with its model states; ZeRO-3 builds the model partitioned (zero.Init). DPO's frozen
    copy under FSDP (reference.frozen_copy) is loaded whole by every process before it is sharded, after the policy
    is on the GPUs: the larger of the two loads."""
    if recipe.fsdp is not None and recipe.dpo_reference == "copy":
        return max(policy_loading_bytes(recipe, s, cb, local), weight_bytes(recipe) * s.params * local)
    return policy_loading_bytes(recipe, s, cb, local)


def policy_loading_bytes(recipe: Recipe, s: Structure, cb: int, local: int) -> int:
    """Host RAM per machine while the trained model loads (loading_bytes)."""
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


@dataclass
class States:
    """Model states per process for one engine (bytes), what of them a layer gathers while it computes, and the host
    RAM per machine they put there: what `estimate` adds activations and the rest to."""
    params: int
    grads: int
    optimizer: int
    host: int = 0
    # of `host`, what is page-locked (torch's pinned allocator, the activation offload's registered arena)
    pinned: int = 0
    gathered_params: int = 0
    gathered_grads: int = 0
    notes: list[str] = field(default_factory=list)

    def add_host(self, more: int, pinned: bool) -> None:
        """`more` bytes of host RAM per machine, page-locked where `pinned`."""
        self.host += more
        if pinned:
            self.pinned += more


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
    cpu: bool = False  # CPU smoke-test mode: the host is the device, and what is offloaded is held beside the rest

    @property
    def local(self) -> int:
        return self.processes // self.machines


# Host memory as it is pinned: DeepSpeed's ZeRO-3 offload pins the tensors zero3_host_tensors lists through torch's
# caching host allocator (its accelerator's pin_memory: `tensor.pin_memory()` unless DS_PIN_MEMORY_BACKEND=native), which
# rounds a block up to a power of two and keeps a freed one cached, pinned, up to `pinned_max_cached_size_mb`:
# memrecipe sets it (PINNED_CACHE_MB, memrecipe/__init__.py), so the large blocks take their own size and are released
# when freed. (The activation offload pins one registered block of its own: training/layers.py HostArena.) A CPU pins
# nothing, and counts the same tensors unrounded.
CACHED = PINNED_CACHE_MB * 2**20


def host_block(request: int) -> int:
    """Bytes torch's CachingHostAllocator holds for a pinned request (aten/src/ATen/core/CachingHostAllocator.h:
    PowerOf2Ceil up to pinned_max_cached_size, then the request as it is)."""
    return 1 << (request - 1).bit_length() if 1 < request <= CACHED else request


def pinned_bytes(kept: list[int], freed: list[int]) -> int:
    """What the host allocator holds for these requests: each kept one its block, and each freed one its block
    where it is small enough to stay cached."""
    return sum(map(host_block, kept)) + sum(host_block(b) for b in freed if b <= CACHED)


def sub_groups(partitions: list[int], size: int) -> list[int]:
    """ZeRO-3's sub groups of one optimizer parameter group, in elements (stage3.py _create_fp16_sub_groups): whole
    parameters' partitions in order, a group closed once it reaches `size`."""
    groups, open_ = [], 0
    for i, numel in enumerate(partitions):
        open_ += numel
        if open_ >= size or i == len(partitions) - 1:
            groups.append(open_)
            open_ = 0
    return groups


def optimizer_groups(train: list[Tensor]) -> list[list[Tensor]]:
    """The loop's optimizer groups as DeepSpeed receives them (training/optimizers.py param_groups: decayed matrices,
    then undecayed norms and biases), each in the model's order: the token embedding first, the layers, the rest."""
    ordered = [t for t in train if t.name == "embed_tokens"] + [t for t in train if t.name != "embed_tokens"]
    groups = [[t for t in ordered if len(t.shape) >= 2], [t for t in ordered if len(t.shape) < 2]]
    return [g for g in groups if g]


def zero3_host_tensors(recipe: Recipe, s: Structure, train: list[Tensor], processes: int,
                       compute_bytes: int) -> dict[str, list[int]]:
    """The bytes of each host tensor a process's ZeRO-3 offload makes, each pinned with `pin_memory: true`, each
    parameter's partition ceil(numel / processes) elements: "params", the 16-bit parameters (with them offloaded:
    every frozen parameter's partition as zero.Init makes it, partition_parameters.py `_partition_param`, and a flat
    buffer per optimizer group the trained ones move into, stage3.py `_create_param_groups_fp16_flat_cpu_memory`);
    "freed", the trained ones' own partitions, freed once moved (into torch's cache where pinned); "grads", with the
    optimizer offloaded, the trained partitions' gradients in one flat buffer of the 16-bit accumulation dtype
    (stage3.py `grad_partitions_flat_buffer`) and an fp32 one per sub group (stage3.py `initialize_optimizer_states`).
    Each is what a real engine asks its accelerator to pin, recorded on CPU (tests/unit/planning/test_pinned.py)."""
    ds = recipe.deepspeed
    groups = [[-(-t.numel // processes) for t in g] for g in optimizer_groups(train)]
    out: dict[str, list[int]] = {"params": [], "freed": [], "grads": []}
    if ds.offload_param != "none":
        frozen = [] if recipe.lora is None else zero3_partitions(s, processes, compute_bytes)
        out["params"] = frozen + [compute_bytes * sum(g) for g in groups]
        out["freed"] = [compute_bytes * p for g in groups for p in g]
    if ds.offload_optimizer != "none":
        out["grads"] = [compute_bytes * sum(p for g in groups for p in g)]
        out["grads"] += [4 * numel for g in groups for numel in sub_groups(g, ds.sub_group_size)]
    return out


def zero3_partitions(s: Structure, processes: int, compute_bytes: int) -> list[int]:
    """The bytes of each parameter's ZeRO-3 partition in 16 bits, ceil(numel / processes) elements, as zero.Init
    makes it (partition_parameters.py `_partition_param`): offloaded, each pinned where `pin_memory`."""
    return [compute_bytes * -(-t.numel // processes) for t in s.tensors()]


def zero3_states(recipe: Recipe, s: Structure, z: Sizes, train: list[Tensor]) -> States:
    """DeepSpeed's own accounting (estimate_zero3_model_states_mem_needs): 16-bit params and grads of the largest
    layer gathered on the GPU; 2 bytes/param of 16-bit weights, 16 of fp32 state per trained param (master, two
    moments, fp32 grad) partitioned. Beside them what its estimator leaves out: the reduce bucket,
    `reduce_bucket_size` elements of the gradients' communication dtype that stage3.py allocates on the device at
    start-up when `contiguous_gradients` is on: the compute dtype (engine.py communication_data_type), fp32 under
    Ulysses (seq_parallel_communication_data_type's default): 0.93 / 1.86 GiB at the default 5e8. Offloaded, the host
    holds the fp32 master and moments (pageable) and the tensors zero3_host_tensors lists, pinned with `pin_memory:
    true` (host_block)."""
    ds, layer, n = recipe.deepspeed, s.largest_module, z.processes
    comm = 4 if recipe.sequence_group(n) > 1 else z.compute_bytes
    bucket = ds.reduce_bucket_size * comm if ds.contiguous_gradients else 0
    out = States(2 * layer, 2 * layer + bucket, 0, gathered_params=2 * layer, gathered_grads=2 * layer,
                 notes=["ZeRO-3 model states follow DeepSpeed's estimate_zero3_model_states_mem_needs, with its "
                        "reduce bucket"])
    # LoRA: the adapters in the compute dtype (adapters.add_lora: the engine's own), partitioned beside the 16-bit
    # frozen base (measured on CPU: 2 bytes an adapter parameter in bf16)
    adapters = z.compute_bytes * z.trained if recipe.lora is not None else 0
    if ds.offload_param == "none" and ds.offload_optimizer == "none":
        out.params, out.grads, out.optimizer = out.params + (2 * z.params + adapters) // n, \
            out.grads + 4 * z.trained // n, 12 * z.trained // n
        if ds.zero3_init:
            out.host = 4 * layer * z.local  # zero.Init materialises one layer at a time per process
        return out
    if ds.offload_param == "none":
        out.params += (2 * z.params + adapters) // n
    moments = 12 * z.trained // n  # CPU Adam's fp32 master and two moments, pageable
    if ds.offload_optimizer == "none":
        out.grads, out.optimizer, moments = out.grads + 4 * z.trained // n, out.optimizer + moments, 0
    host = zero3_host_tensors(recipe, s, train, n, z.compute_bytes)
    if z.cpu:  # the host is the device: what is offloaded is held beside the rest, in the rows a run measures it in
        # (probes.held_bytes); nothing pinned
        out.params += sum(host["params"])
        out.grads += sum(host["grads"])
        out.optimizer += moments
    elif ds.pin_memory:  # each tensor as torch's host allocator holds it, the small freed ones cached
        out.pinned = z.local * pinned_bytes(host["params"] + host["grads"], host["freed"])
        out.host = z.local * moments + out.pinned
    else:
        out.host = z.local * (moments + sum(host["params"]) + sum(host["grads"]))
    return out


def zero2_states(recipe: Recipe, z: Sizes, train: list[Tensor]) -> States:
    """ZeRO-1/2, DeepSpeed's own accounting (estimate_zero2_model_states_mem_needs): 16-bit weights replicated;
    16-bit and fp32 gradients, fp32 master weights and moments partitioned, or, with optimizer offload, all of that
    in host RAM; loading puts a full fp32 copy per process on the host. Offloaded on a GPU box, each process's host
    tensors as zero2_host_tensors lists them (the estimator leaves out the 16-bit buffers), CPU Adam's moments
    pageable beside them."""
    notes = ["ZeRO-1/2 model states follow DeepSpeed's estimate_zero2_model_states_mem_needs"]
    if recipe.deepspeed.offload_optimizer != "none":
        host = max(4 * z.params * z.local, 16 * z.trained // z.machines)
        if z.cpu:
            return States(2 * z.params, 0, 0, host, notes=notes)
        pinned, pageable = 0, 0
        for rank in range(z.local):  # (the first machine's processes; partitions differ only where they meet)
            tensors, partitions = zero2_host_tensors(recipe, train, z.processes, rank, z.compute_bytes)
            pageable += 8 * partitions  # CPU Adam's two fp32 moments
            if recipe.deepspeed.pin_memory:
                pinned += pinned_bytes(tensors, [])
            else:
                pageable += sum(tensors)
        return States(2 * z.params, 0, 0, max(4 * z.params * z.local, pageable + pinned), pinned=pinned, notes=notes)
    n = z.processes
    return States(2 * z.params, 6 * z.trained // n, 12 * z.trained // n, 4 * z.params * z.local, notes=notes)


def zero2_host_tensors(recipe: Recipe, train: list[Tensor], processes: int, rank: int,
                       compute_bytes: int) -> tuple[list[int], int]:
    """The bytes of each host tensor process `rank`'s ZeRO-1/2 optimizer offload makes, pinned with `pin_memory:
    true` (stage_1_and_2.py), and the elements of its partitions: per optimizer group, its partition (the group's
    flat 16-bit weights padded to 2 x processes elements, cut in equal parts) as fp32 master weights and a 16-bit
    buffer (`single_partition_of_fp32_groups`, `param_buffer_of_bit16_for_cpu_offload_groups`) and an fp32 gradient
    (`initialize_optimizer_states`); a 16-bit buffer of the largest trained parameter
    (`temp_grad_buffer_for_cpu_offload`); under gradient accumulation, made at the first backward, a 16-bit buffer
    of every parameter the partition holds a part of, whole (`async_accumulate_grad_in_cpu_via_gpu`). Each is what a
    real engine asks its accelerator to pin, recorded on CPU (tests/unit/planning/test_pinned.py)."""
    tensors, accumulated, partitions = [], [], 0
    for group in optimizer_groups(train):
        size = -(-sum(t.numel for t in group) // (2 * processes)) * 2
        start, offset = rank * size, 0
        for t in group:
            if offset < start + size and offset + t.numel > start:
                accumulated.append(compute_bytes * t.numel)
            offset += t.numel
        tensors += [4 * size, compute_bytes * size, 4 * size]
        partitions += size
    tensors.append(compute_bytes * max(t.numel for t in train))
    return tensors + (accumulated if recipe.gradient_accumulation_steps > 1 else []), partitions


def fsdp_states(recipe: Recipe, s: Structure, z: Sizes, train: list[Tensor]) -> States:
    """FSDP's shards, the units it gathers (the running one and the prefetched one, or all of it without
    resharding), a full unit's gradients before the reduce-scatter; with parameter offload, the shards on the host,
    pinned on a GPU box as fsdp_host_tensors (FSDP2) or fsdp1_host_tensors (FSDP1's flat parameters) list them, the
    optimizer's state pageable."""
    f, n, cb = recipe.fsdp, z.processes, z.compute_bytes
    tp = recipe.tensor_parallel
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
        host, pinned = fsdp_offload_host(recipe, s, z, train, sharded)
        out = States(units + scales, unit_grads, 0, host, pinned=pinned)
    else:
        out = States(sharded + units + scales, 4 * z.trained // n + unit_grads, z.optimizer // n)
    out.gathered_params, out.gathered_grads = units, unit_grads
    if scales:
        out.notes.append(f"each GPU keeps the whole base's quantization scales ({scales / GiB:.2f} GiB): FSDP shards "
                         "only the packed weights")
    return out


def fsdp_offload_host(recipe: Recipe, s: Structure, z: Sizes, train: list[Tensor], sharded: int) -> tuple[int, int]:
    """The host bytes FSDP's parameter offload takes a machine, and how many of them are pinned: on a GPU box as
    fsdp_host_tensors (FSDP2) or fsdp1_host_tensors (FSDP1's flat parameters, a quantized base's too) list them, the
    optimizer's state beside them pageable; a CPU pins nothing."""
    n = z.processes
    whole = (sharded + 4 * z.trained // n + z.optimizer // n) * z.local
    if z.cpu:
        return whole, 0
    listed = fsdp_host_tensors if recipe.fsdp.version == 2 else fsdp1_host_tensors
    pinned = z.local * pinned_bytes(listed(recipe, s, train, n, z.compute_bytes), [])
    return pinned + z.local * z.optimizer // n, pinned


def fsdp_host_tensors(recipe: Recipe, s: Structure, train: list[Tensor], processes: int,
                      compute_bytes: int) -> list[int]:
    """The bytes of each host tensor a process's FSDP2 parameter offload pins (accelerate's CPUOffloadPolicy, whose
    pin_memory is on): each parameter's shard (dim 0 padded to a multiple of the processes, _fsdp_param.py
    `padded_sharded_param.pin_memory()`), trained ones in fp32 and a LoRA's frozen base in the compute dtype; and
    each trained shard's gradient, copied to the host without blocking (_fsdp_collectives.py foreach_reduce:
    `.to("cpu", non_blocking=True)` makes a pinned tensor; later micro batches add into it). Read off torch's
    source: a CPU pins nothing, and FSDP's offload runs on CUDA only."""
    trained = [4 * fsdp2_shard(t, processes) for t in train]
    frozen = [compute_bytes * fsdp2_shard(t, processes) for t in s.tensors()] if recipe.lora else []
    return frozen + trained + trained


def fsdp2_shard(t: Tensor, processes: int) -> int:
    """Elements of one process's FSDP2 shard of a parameter: dim 0 padded to a multiple of the processes."""
    return -(-t.shape[0] // processes) * (t.numel // t.shape[0])


def fsdp1_host_tensors(recipe: Recipe, s: Structure, train: list[Tensor], processes: int,
                       compute_bytes: int) -> list[int]:
    """The bytes of each host tensor a process's FSDP1 parameter offload pins: each flat parameter's shard
    (`_local_shard.pin_memory()`) and a pinned `_cpu_grad` of the same size, frozen or not (torch/distributed/fsdp/
    _flat_param.py FlatParamHandle.init_flat_param_attributes). A flat parameter per FSDP unit: a full fine-tune's
    decoder layers and the root (embeddings, final norm, head), each fp32 (accelerate upcasts a trained 16-bit flat
    parameter before FSDP's lazy init pins it); with LoRA, PEFT's wrap policy (use_orig_params=false:
    training.accelerator.wrap_first) gives each adapter matrix a unit of its own (fp32), and each layer's frozen
    base and the root stay in the base's dtype: the compute dtype, or a 4-bit base's storage dtype with its packed
    weights in it (its scales are no part of a flat parameter: quant_state_bytes)."""
    q, aligned = recipe.quantization, 16 // compute_bytes if recipe.fsdp.use_orig_params else 0
    e = 4 if recipe.lora is None else {"bf16": 2, "fp16": 2, "fp32": 4}.get(q.quant_storage, compute_bytes) if q \
        else compute_bytes  # (bytes an element of the layers' and the root's flat parameters)

    def numel(t: Tensor) -> int:  # (a 4-bit weight packs two to a byte, in e-byte elements)
        return -(-math.ceil(t.numel / 2) // e) if q and t.kind == "linear" and t.name != "lm_head" else t.numel

    units = [(4, [t.numel]) for t in train] if recipe.lora else []  # (bytes an element, the numels it flattens)
    units += [(e, [numel(t) for t in g.layer_tensors()]) for g in s.groups() for _ in range(g.layers)]
    units.append((e, [t.numel for t in s.tensors()[-len(s.top_params):]]))
    return [size * flat_shard(numels, processes, aligned) for size, numels in units for _ in range(2)]


def flat_shard(numels: list[int], processes: int, aligned: int = 0) -> int:
    """Elements of one process's shard of an FSDP1 flat parameter of these tensors (_flat_param.py
    _init_flat_param_and_metadata: under use_orig_params each tensor starts at a multiple of `aligned` elements, 16
    bytes of the compute dtype; _get_shard: the whole padded to a chunk a process)."""
    total = 0
    for n in numels:
        total += (-total % aligned if aligned else 0) + n
    return -(-total // processes)


def plain_states(recipe: Recipe, s: Structure, z: Sizes, train: list[Tensor]) -> States:
    """One process, or DDP: the whole model, its trainable gradients (twice under DDP: its buckets), the state."""
    grads = z.weight_bytes * z.trained
    if recipe.optimizer_in_backward:  # each gradient is freed by its parameter's update: one at a time
        grads = z.weight_bytes * max(t.numel for t in train)
    elif z.processes > 1:
        grads += z.weight_bytes * z.trained  # DDP's gradient buckets: a second copy of the trainable gradients
    base = base_bytes(recipe, s, z.compute_bytes) if recipe.lora else 0
    return States(base + z.weight_bytes * z.trained, grads, z.optimizer)


def add_reference(recipe: Recipe, s: Structure, z: Sizes, states: States) -> None:
    """DPO's reference, where it is a second copy: of the initial model (loaded as the policy is; sharded under
    FSDP2, and with its parameter offload each parameter's shard pinned in host memory; partitioned under ZeRO-3 in
    the engine's compute dtype and offloaded with the policy's parameters: each parameter's partition pinned where
    `pin_memory`, as zero.Init pins the policy's frozen ones, its engine without an optimizer making no flat buffers;
    both recorded on CPU, tests/unit/planning/test_pinned.py), or of a saved adapter (fp32, as loaded) beside the one
    that trains."""
    zero3 = recipe.deepspeed is not None and recipe.deepspeed.zero_stage == 3
    n = z.processes
    if recipe.dpo_reference == "copy":
        fsdp_offload = bool(recipe.fsdp and recipe.fsdp.offload_params)
        offloaded = fsdp_offload or zero3 and recipe.deepspeed.offload_param != "none"
        copy = z.compute_bytes * z.params // n if zero3 else z.weight_bytes * z.params // (n if recipe.fsdp else 1)
        pinned = not z.cpu and (fsdp_offload or offloaded and recipe.deepspeed.pin_memory)
        if pinned:  # (FSDP2's offload pins each parameter's shard of the copy, in the weights' dtype)
            copy = pinned_bytes(zero3_partitions(s, n, z.compute_bytes) if zero3 else
                                [z.weight_bytes * fsdp2_shard(t, n) for t in s.tensors()], [])
        if offloaded:
            states.add_host(copy * z.local, pinned)
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
        return zero3_states(recipe, s, z, train) if recipe.deepspeed.zero_stage == 3 else zero2_states(recipe, z, train)
    if recipe.fsdp:
        return fsdp_states(recipe, s, z, train)
    return plain_states(recipe, s, z, train)
