"""What is done to the loaded model's decoder layers: activation checkpointing (and its inputs offloaded to
host memory), tensor parallelism, compile."""

from __future__ import annotations

import contextvars
import itertools

import torch

from ..errors import RecipeError

# True while torch's checkpoint runs a layer again in backward to rebuild what it saved (marked, below)
RECOMPUTING = contextvars.ContextVar("recomputing", default=False)
# True while a tiled MLP runs its tiles (training.tiling): selective checkpointing caches none of their matmuls
TILING = contextvars.ContextVar("tiling", default=False)


class CopyStreams:
    """Where HostOffload's copies run on CUDA: a side stream, ordered against the compute stream by events, so that
    a copy overlaps the layers around it instead of queueing between them (torchtune's OffloadActivations is the
    reference design). Tests stand in a recorder with the same methods (no side stream exists on CPU)."""

    def __init__(self, device):
        self.side, self.device = torch.cuda.Stream(device), device

    def side_waits_compute(self):  # the tensor to copy is written
        self.side.wait_stream(torch.cuda.current_stream(self.device))

    def on_side(self):
        return torch.cuda.stream(self.side)

    def record(self):
        return self.side.record_event()

    def compute_waits(self, event):
        torch.cuda.current_stream(self.device).wait_event(event)

    def used_by_compute(self, tensor):  # made on the side stream, freed after the compute stream's use
        tensor.record_stream(torch.cuda.current_stream(self.device))

    @staticmethod
    def done(event) -> bool:
        return event.query()

    def finish(self):  # every copy issued so far has run
        self.side.synchronize()


class HostArena:
    """The offload's host memory: one block, sliced per saved tensor in the order forward saves them, sized to the
    most one forward saved: the bytes the tensors hold. torch's pinned allocator (torch.empty(pin_memory=True), its
    CachingHostAllocator) rounds each block up to a power of two (aten/src/ATen/core/CachingHostAllocator.h:
    PowerOf2Ceil up to pinned_max_round_threshold_mb, unset by default; memrecipe's pinned_max_cached_size_mb stops it
    above 64 MB, but a freed block below that stays cached): a layer input of 4.74 GB took 8 GiB, and the offload of
    an 8B at 565K tokens 256 GiB where it holds 141. On CUDA the block is a plain host tensor pinned by
    registering it (cudaHostRegister, as torch's checkpoint stager pins: torch/cuda/_pin_memory_utils.py). A forward
    that saves more than the block holds (the first; a longer batch) puts the rest in pageable tensors of their own,
    and the next forward's block holds it all."""

    ALIGN = 512  # each slice starts aligned: a view of any dtype, and the copy engine's alignment

    def __init__(self):
        self.block: torch.Tensor | None = None
        self.pinned = False
        self.wanted = 0  # bytes this forward's tensors take, slices aligned

    @property
    def size(self) -> int:
        return 0 if self.block is None else self.block.numel()

    def restart(self, finish=None) -> None:
        """A new forward: nothing in the block waits for backward any more. The block grows to what the last forward
        saved, after `finish()` (the copies still reading the old one)."""
        if self.wanted > self.size:
            if finish is not None:
                finish()
            self.release()
            self.block = torch.empty(self.wanted, dtype=torch.uint8)
        self.wanted = 0

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """An empty host tensor of `tensor`'s shape and dtype: a slice of the block where it fits, pinned on CUDA."""
        nbytes = tensor.numel() * tensor.element_size()
        start, self.wanted = self.wanted, self.wanted + -(-nbytes // self.ALIGN) * self.ALIGN
        if self.block is None or self.wanted > self.size:
            return torch.empty(tensor.shape, dtype=tensor.dtype)  # pageable, this forward only
        if tensor.device.type == "cuda" and not self.pinned:
            from torch.cuda._pin_memory_utils import pin_memory

            pin_memory(self.block.data_ptr(), self.size)
            self.pinned = True
        return self.block[start:start + nbytes].view(tensor.dtype).view(tensor.shape)

    def release(self) -> None:
        if self.pinned and self.block is not None:
            from torch.cuda._pin_memory_utils import unpin_memory

            unpin_memory(self.block.data_ptr())
        self.block, self.pinned = None, False


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Tensors saved for backward inside this context wait in pinned host memory and come back to their device in
    backward. On CUDA both copies run on a side stream (CopyStreams): forward's device-to-host copy keeps the device
    tensor alive until its event says it is done; backward's host-to-device copy of the tensor needed next (the
    previous layer's, in backward order) is issued as soon as the current one is unpacked, so it overlaps this
    layer's recompute, and the compute stream waits on its event only when it needs it. On CPU (smoke-test mode)
    the tensor stays where it is, host memory already; `copy_on_cpu` parks a copy, for tests. Counts what it holds."""

    def __init__(self, copy_on_cpu: bool = False, streams=None):
        self.tensors = self.bytes = self.copied = 0
        self.copy_on_cpu, self.streams = copy_on_cpu, streams
        self.key = 0
        self.host, self.alive, self.back = {}, {}, {}  # key -> host copy; -> (device tensor, event); -> fetched
        self.arena = HostArena()  # where the host copies live: exact bytes, pinned on CUDA
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor):
        if self.streams is None and tensor.device.type == "cuda":
            self.streams = CopyStreams(tensor.device)
        streams = self.streams
        if streams is not None and tensor.device != streams.device:
            return tensor.device, tensor  # a host tensor saved beside the device's (seen on CUDA): stays, uncounted
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()
        if streams is None:
            if not self.copy_on_cpu:
                return tensor.device, tensor
            self.copied += 1
            return tensor.device, tensor.detach().clone()  # a separate host tensor, as on CUDA
        self._release_copied()
        if not self.host and not self.back:  # a new forward: backward took every copy of the last one
            self.arena.restart(streams.finish)
        streams.side_waits_compute()
        with streams.on_side():
            host = self.arena.take(tensor)
            host.copy_(tensor, non_blocking=True)
            event = streams.record()
        self.copied += 1
        self.key += 1
        self.host[self.key], self.alive[self.key] = (tensor.device, host), (tensor, event)
        return None, self.key

    def _unpack(self, packed):
        device, tensor = packed
        if device is not None:  # not on a side stream: the tensor itself, or its host copy
            return tensor.to(device)
        key = tensor
        fetched, event = self.back.pop(key, None) or self._fetch(key)
        self.streams.compute_waits(event)
        self.streams.used_by_compute(fetched)
        if key - 1 in self.host:  # prefetch: the next tensor backward unpacks (the previous layer's input)
            self.back[key - 1] = self._fetch(key - 1)
        return fetched

    def _fetch(self, key):
        self._release_copied()
        device, host = self.host.pop(key)
        with self.streams.on_side():
            fetched = host.to(device, non_blocking=True)
            return fetched, self.streams.record()

    def _release_copied(self):
        """Drop the device tensors whose copy to the host has finished."""
        for key in [k for k, (_, event) in self.alive.items() if self.streams.done(event)]:
            del self.alive[key]


def selective_policy(ctx, op, *args, **kwargs):
    """Selective activation checkpointing's choice per op (TorchTitan's op-level policy): keep what is costly to
    compute again, the matmuls' and attention's outputs, and recompute the cheap elementwise ops (norms, rotary,
    activations, casts) in backward. A tiled MLP's matmuls are not kept (TILING): its backward recomputes them tile
    by tile anyway, and kept they were its [tokens x intermediate] tensors over the whole sequence, which the tiles
    exist to avoid."""
    from torch.utils.checkpoint import CheckpointPolicy

    keep = op in SAVED_OPS and not TILING.get()
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_cudnn_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def enable_checkpointing(model, offload: bool, selective: bool = False, stop_early: bool = True,
                         mark: bool = False) -> HostOffload | None:
    """The model's own (non-reentrant) gradient checkpointing; with offload, each checkpointed
    layer's saved input goes to host memory. transformers' own offload=True always pins memory,
    which fails on a machine without CUDA (measured), so the offload wraps its checkpoint function.
    `selective`: each layer keeps its matmuls' and attention's outputs too (selective_policy), recomputing the rest:
    torch's create_selective_checkpoint_contexts, handed to torch.utils.checkpoint through transformers' kwargs.
    `stop_early` false: each recompute runs its layer to the end (the tiled MLP's, below). `mark`: RECOMPUTING says
    when a recompute runs (marked)."""
    import functools

    # non-reentrant: works with frozen inputs (LoRA) and with FSDP/DeepSpeed. Early stop ends a recompute by raising
    # from the saved-tensor hook at the layer's last save, which with a tiled MLP is the MLP's own (an autograd Function
    # recomputed inside another one's backward): torch 2.11 on CUDA lost that exception ("SystemError: apply returned
    # NULL", the first GPU run of the top rung), so the loop turns it off there (nothing after that save but a residual
    # add). Under ZeRO-3 it stays on: a whole recompute meets parameters ZeRO has released again (shape [0]) where the
    # forward saved activations, and torch's check of the recomputed tensors fails (measured on CPU, LoRA + dropout).
    kwargs: dict[str, object] = {"use_reentrant": False, "early_stop": stop_early}
    if selective:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_policy)
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    hooks = HostOffload() if offload else None
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            if mark:
                module._gradient_checkpointing_func = functools.partial(marked, module._gradient_checkpointing_func)
            if hooks is not None:
                module._gradient_checkpointing_func = functools.partial(offloaded, hooks,
                                                                        module._gradient_checkpointing_func)
    return hooks


def offloaded(hooks: HostOffload, checkpoint, *args, **kwargs):
    with hooks:  # the checkpoint saves its inputs under our hooks; the recompute's tensors stay on the device
        return checkpoint(*args, **kwargs)


def marked(checkpoint, function, *args, **kwargs):
    """torch's non-reentrant checkpoint calls `function` (the layer) once in forward and again in backward, to rebuild
    what the layer saved; RECOMPUTING says which call runs (training.tiling leaves out, in the second, an MLP whose
    output nothing saves)."""
    calls = itertools.count()

    def layer(*inner, **named):
        token = RECOMPUTING.set(next(calls) > 0)
        try:
            return function(*inner, **named)
        finally:
            RECOMPUTING.reset(token)

    return checkpoint(layer, *args, **kwargs)


def tensor_parallel(model, tp_size: int, device_mesh) -> None:
    """Split the model's linears over the mesh's "tp" dimension with its own TP plan (colwise/rowwise per
    linear); FSDP2 then shards over the mesh's other dimensions. transformers' from_pretrained(distributed_config)
    would build a mesh of its own that must span every process (transformers/distributed/utils.py,
    initialize_distributed_mesh), so a tp 2 x dp 2 run on 4 ranks fails there: the plan is applied here
    on accelerate's mesh instead. Every rank holds the loaded weights and keeps its own slice of each
    (distribute_tensor with src_data_rank=None: no communication)."""
    from transformers import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    config = DistributedConfig(tp_plan="auto", tp_size=tp_size)
    plan, _, _ = model._resolve_parallel_plans(config)
    tp_mesh = device_mesh["tp"] if device_mesh.mesh_dim_names != ("tp",) else device_mesh
    apply_tensor_parallelism(model, tp_mesh, plan)
    model.config.distributed_config = config  # where accelerate reads the TP size (utils/other.py, get_model_tp_size)


def compile_layers(model) -> int:
    """Compile each decoder layer in place (nn.Module.compile), as torchtune does and accelerate's regional
    compilation: the layers share one graph (dynamo treats their weights as inputs), checkpointing wraps
    the compiled layer, and the model keeps its modules, hooks and state-dict names. The head, the fused
    loss and the mask building stay eager. Returns the number of layers compiled."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RecipeError(f"torch_compile: {type(model).__name__} names no decoder-layer class (_no_split_modules)")
    # transformers 5.25's attention forward (the kernels package's use_kernelized_func) sets and resets a context
    # variable around it: inside a checkpoint, a side effect dynamo breaks the graph on, since the recompute would not
    # replay it. A set undone before the forward returns needs no replay; unbroken, every layer shares one graph.
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in layers:
        layer.compile()
    return len(layers)


def apply(model, recipe, accelerator) -> HostOffload | None:
    """The checkpointing rungs (selective, full, the offload to host: planning/rungs.py): the loop's own checkpointing
    as the recipe asks (fsdp.activation_checkpointing is the engine's wrapper, applied in prepare). Returns the
    offload's hooks, or None."""
    if not recipe.gradient_checkpointing:
        return None
    return enable_checkpointing(model, recipe.activation_offload, recipe.gradient_checkpointing == "selective",
                                stop_early=recipe.tiled_mlp is False or recipe.deepspeed is not None,
                                mark=recipe.recompute_skips_tiles)
