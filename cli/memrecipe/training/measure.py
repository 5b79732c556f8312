"""What a run measures about itself: how the model is really wrapped, memory, throughput."""

from __future__ import annotations

import gc
import os
import resource
import sys
import time
from dataclasses import dataclass, field

import torch

from .. import ALLOCATOR_CONF
from ..planning.optimizers import OPTIMIZERS, bf16_rounding
from ..planning.registry import embedded_settings_said, is_embedded
from . import cpu_matmul
from .norms import lean_forward
from .ring import Ring
from .tiling import tiled_forward

# accelerate's distributed types, in words for the start-up line
ENGINES = {"NO": "plain (no DDP/FSDP/DeepSpeed)", "MULTI_CPU": "DDP (gloo)", "MULTI_GPU": "DDP", "FSDP": "FSDP",
           "DEEPSPEED": "DeepSpeed"}


def describe_setup(accelerator, model, optimizer) -> dict:
    """Facts read off the live objects, so a test (or a user) can see the recipe really took effect."""
    from torch.distributed.fsdp import FSDPModule

    params = list(model.parameters())
    inner = getattr(optimizer, "optimizer", optimizer)  # (accelerate's AcceleratedOptimizer wraps it)

    def numel(p) -> int:  # ZeRO-3 partitions hold ds_numel; a packed 4-bit weight knows its real shape
        q = getattr(p, "quant_state", None)
        return q.shape.numel() if q is not None else getattr(p, "ds_numel", p.numel())

    facts = {
        "distributed_type": accelerator.distributed_type.value,
        "engine": ENGINES.get(accelerator.distributed_type.value, accelerator.distributed_type.value),
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "device": str(accelerator.device),
        "mixed_precision": accelerator.mixed_precision,
        "model_class": type(model).__name__,
        "fsdp2_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "dtensor_params": sum(type(p).__name__ == "DTensor" for p in params),
        "params": sum(numel(p) for p in params),
        "trainable_params": sum(numel(p) for p in params if p.requires_grad),
        # bitsandbytes weights (Params4bit/Int8Params): their numel above is the packed storage's
        "quantized_weights": sum(type(p).__name__ in ("Params4bit", "Int8Params") for p in params),
        "trainable_names_all_lora": all("lora_" in n for n, p in model.named_parameters() if p.requires_grad),
        "optimizer_class": _optimizer_class(optimizer),
        "optimizer_in_backward": hasattr(inner, "optimizers"),
        # seconds make_optimizer spent compiling the step before step 1 (torchao on CUDA), else 0
        "optimizer_compile_seconds": getattr(inner, "compile_seconds", 0.0),
        "gradient_checkpointing": _checkpointing(accelerator.unwrap_model(model)),
        "tiled_mlps": _runs_as(model, tiled_forward),
        "lean_norms": _runs_as(model, lean_forward),
        # LoRA layers whose adapters read their input as it comes (training.adapters.share_inputs)
        "lora_shared_inputs": sum(getattr(m, "cast_input_dtype_enabled", True) is False for m in model.modules()),
        # adapters whose dropout runs in a checkpoint of its own (training.adapters.recompute_dropout)
        "lora_recomputed_dropout": sum(hasattr(m, "input_dropout") for m in model.modules()),
        # the kernel transformers runs, and why (training.loading.attention: attn_implementation auto resolved)
        "attention": getattr(getattr(accelerator.unwrap_model(model), "config", None), "_attn_implementation", None),
        "attention_why": getattr(getattr(accelerator.unwrap_model(model), "memrecipe_attention", None), "why", None),
        # bf16 matmuls through fp32 GEMMs, where the CPU has no bf16 GEMM (training.cpu_matmul)
        "bf16_matmuls_in_fp32": cpu_matmul.active(),
        "cpu_threads": torch.get_num_threads(),  # what CPU work (DeepSpeed's CPU Adam, collation) runs on
        # the CUDA allocator's configuration (memrecipe/__init__.py sets one unless the user did)
        "allocator_conf": ", ".join(f"{k}={os.environ[k]}" for k in ALLOCATOR_CONF if k in os.environ) or None,
        # ... and what the allocator applied: read off its segments, not the variable (None off CUDA)
        "allocator_expandable_segments": _expandable_segments(accelerator.device),
    }
    facts["sequence_parallel"] = getattr(model, "sequence_parallel_size", 1)  # the engine's Ulysses group (1: none)
    facts["ulysses_attention"] = _ulysses(facts["attention"])
    facts["context_parallel"] = Ring(accelerator).size  # ring attention's group, as accelerate prepared it (1: none)
    if hasattr(model, "zero_optimization_stage"):  # a DeepSpeedEngine
        facts["zero_stage"] = model.zero_optimization_stage()
        offload_param = model.zero_offload_param()
        facts["zero_offload_optimizer"] = model.zero_cpu_offload()
        facts["zero_offload_param"] = offload_param is not None and str(getattr(offload_param.device, "value", offload_param.device)) == "cpu"
        facts["optimizer_class"] = type(model.optimizer).__name__
        facts["client_optimizer_class"] = type(model.optimizer.optimizer).__name__ \
            if hasattr(model.optimizer, "optimizer") else None
    return facts


def _ulysses(attention) -> bool:
    """Whether transformers' attention function for this kernel is DeepSpeed's Ulysses wrapper (registered in its
    place by accelerate's prepare under sequence parallelism: UlyssesSPAttentionHF.register_with_transformers)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    function = ALL_ATTENTION_FUNCTIONS.get(attention) if attention else None
    return getattr(function, "__name__", "") == "uattn_wrapper"


def _optimizer_class(optimizer) -> str:
    """The optimizer's class; with the step in backward, the class of the per-parameter optimizers."""
    inner = getattr(optimizer, "optimizer", optimizer)
    each = getattr(inner, "optimizers", None)
    return type(next(iter(each.values()))).__name__ if each else type(inner).__name__


def optimizer_state_dtypes(optimizer) -> list[str]:
    """The dtypes of the optimizer's state tensors (8-bit bitsandbytes state shows as uint8)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    state = getattr(inner, "state", {})
    # torchao's 8-bit state shows its float dtype outside; its codes are what it stores
    stored = [getattr(v, "codes", v) for s in state.values() for v in s.values() if torch.is_tensor(v)]
    return sorted({str(v.dtype).removeprefix("torch.") for v in stored if v.numel() > 1})


def window_counts(window: list[dict], targets: int, reduce, tp_size: int = 1) -> tuple[dict, int]:
    """A step's counts over all processes, each batch once: target tokens (`targets`, already summed over
    processes), real (non-padding) tokens and slots (what the batches' shape computed on); and this
    process's real tokens. `reduce` sums a tensor over processes. The ranks of a tensor-parallel group
    share one batch (accelerate shards the data over the other mesh dimensions), so sums over processes
    count each batch tp_size times."""
    local = sum(int(b["attention_mask"].sum()) for b in window)
    slots = sum(b["input_ids"].numel() for b in window)
    real, slots = reduce(torch.tensor([local, slots])).tolist()
    return {"targets": targets // tp_size, "tokens": real // tp_size, "slots": slots // tp_size}, local


def peak_memory(device) -> dict:
    """Peak memory of this process: CUDA allocator peaks on GPU, peak RSS always (bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"peak_rss_bytes": rss if sys.platform == "darwin" else rss * 1024}
    if device.type == "cuda":
        out |= {"cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device)}
        # pinned host memory as torch's CachingHostAllocator holds it: blocks rounded up to a power of two
        # (the activation offload's), what the plan's host figure must cover
        host = getattr(torch.cuda, "host_memory_stats", dict)()
        out |= {f"cuda_host_{key.replace('.', '_')}": host[key] for key in ("allocated_bytes.peak", "active_bytes.peak")
                if isinstance(host.get(key), int)}
    return out


class DeviceSampler:
    """The most device memory in use while training runs, sampled every `every` seconds in a thread: on CUDA,
    torch.cuda.mem_get_info (what the driver says is used on the device: the CUDA context, kernels, NCCL's buffers
    and the allocator's reserved segments, none of which max_memory_allocated sees; the whole plan's figure, its
    allowance included, is what this is held to). Device-wide: on a GPU shared with other processes it counts
    theirs too. `read`: () -> bytes in use (tests plant one)."""

    def __init__(self, device, every: float = 0.05, read=None):
        import threading

        if read is None and getattr(device, "type", None) == "cuda":
            def read():
                free, total = torch.cuda.mem_get_info(device)
                return total - free
        self.read, self.peak, self.every = read, None, every
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True) if read is not None else None
        if self._thread is not None:
            self._thread.start()

    def _sample(self):
        used = self.read()
        self.peak = used if self.peak is None else max(self.peak, used)

    def _run(self):
        while True:
            self._sample()
            if self._done.wait(self.every):
                return

    def stop(self) -> int | None:
        """Stops sampling (one last sample) and returns the peak, or None where nothing samples (CPU)."""
        if self._thread is not None:
            self._done.set()
            self._thread.join()
            self._thread = None
            self._sample()
        return self.peak


class LossMemory:
    """Peak bytes the loss adds, measured once: from the output head's forward until the gradient of
    its input exists (head, logits or chunks, cross-entropy, their backward), above what was held when
    the head started. CUDA: the allocator's peak (reset at the head: transients before it leave that
    figure); CPU: the profiler's allocation events, an allocator-level record of every byte, up to a
    marker set when the head's input gets its gradient (a profiler cannot stop inside backward), and it
    stops when the model's next forward starts: the rest of the window runs unprofiled."""

    MARK = "memrecipe::loss_done"

    def __init__(self, model, device):
        from .loss import output_head

        self.device, self._bytes, self._profiler, self._model = device, None, None, model
        self.before_peak = None  # CUDA: the allocator's peak before the window (loading, setup, forward to the head)
        self._hook = output_head(model).register_forward_pre_hook(self._start)

    def _start(self, module, args):
        hidden = args[0] if args else None
        if hidden is None or not hidden.requires_grad or not torch.is_grad_enabled():
            return  # eval, or no gradient flows back through the head: wait for a training forward
        self._hook.remove()
        if self.device.type != "cuda" and torch.autograd.profiler._is_profiler_enabled:
            return  # a memory snapshot is profiling this step already: one profiler per thread
        # no garbage collection inside the window: freeing an earlier step's tensors there would be
        # counted against this one (the profiler remembers blocks it saw allocated in earlier profiles)
        gc.collect()
        gc.disable()
        if self.device.type == "cuda":
            # the peak so far is loading's and setup's own (bitsandbytes quantizing on the GPU, DPO's store pass,
            # the frozen copy) and the first forward up to the head: kept before the window resets it
            self.before_peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                    profile_memory=True)
            self._profiler.__enter__()
            self._stop = self._model.register_forward_pre_hook(self._finish)
        hidden.register_hook(self._mark)

    def _mark(self, grad):
        gc.enable()
        if self.device.type == "cuda":
            self._bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            with torch.profiler.record_function(self.MARK):
                pass

    def _finish(self, module, args):
        self.bytes  # noqa: B018  (reading it stops the profile; a hook that returned it would replace args)

    @property
    def bytes(self) -> int | None:
        """The measured peak (None before a training micro batch went through the head)."""
        if self._profiler is not None:  # stop the profile (after backward) and read it
            self._stop.remove()
            self._profiler.__exit__(None, None, None)
            self._bytes, self._profiler = allocation_peak(self._profiler, until=self.MARK), None
        return self._bytes


def allocation_peak(profiler, until: str | None = None) -> int:
    """Most bytes allocated at once above the start of a CPU profile made with profile_memory=True,
    up to the first event named `until` (the whole profile without it)."""
    events = profiler.profiler.kineto_results.events()
    stop = min((e.start_ns() for e in events if e.name() == until), default=None) if until else None
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"
                         and e.device_type() == torch.autograd.DeviceType.CPU and (stop is None or e.start_ns() <= stop))
    now = peak = 0
    for _, nbytes in allocations:
        now += nbytes
        peak = max(peak, now)
    return peak


def _expandable_segments(device) -> bool | None:
    """Whether the CUDA allocator really grows its segments in place (expandable_segments applied): read off its
    segments, each of which says so (torch.cuda.memory_snapshot()'s is_expandable, as torch's own test_cuda reads
    it), not the environment variable. None off CUDA, or before the allocator holds a segment."""
    if getattr(device, "type", None) != "cuda":
        return None
    flags = [segment["is_expandable"] for segment in torch.cuda.memory_snapshot() if "is_expandable" in segment]
    return any(flags) if flags else None


def _runs_as(model, forward) -> int:
    """How many of the model's modules had their forward replaced by functools.partial(forward, ...)."""
    return sum(getattr(getattr(m, "forward", None), "func", None) is forward for m in model.modules())


def _checkpointing(model) -> bool | str:
    """True when the model's layers checkpoint, "selective" when they keep their matmuls' and attention's outputs
    too (a context_fn handed to torch.utils.checkpoint: training.layers.enable_checkpointing)."""
    base = getattr(model, "get_base_model", lambda: model)()
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # newest transformers first
        if name in dir(type(base)):
            on = bool(getattr(base, name))
            break
    else:
        return False
    functions = [m._gradient_checkpointing_func for m in base.modules() if getattr(m, "gradient_checkpointing", False)
                 and hasattr(m, "_gradient_checkpointing_func")]
    return "selective" if on and any("context_fn" in getattr(f, "keywords", {}) for f in functions) else on


def start_trackers(accelerator, recipe, out) -> bool:
    """accelerate's own trackers (tensorboard, wandb) for the run folder, once the folder is known.
    Returns False (with one line saying what to install) when the tracker's package is missing."""
    if recipe.report_to == "none":
        return False
    from accelerate.tracking import filter_trackers

    accelerator.project_configuration.set_directories(str(out))
    accelerator.log_with = filter_trackers([recipe.report_to], accelerator.logging_dir)
    if not accelerator.log_with:
        accelerator.print(f"memrecipe: report_to {recipe.report_to} is not installed (pip install "
                          f"'memrecipe[tracking]' for tensorboard, or wandb): training without it")
        return False
    accelerator.init_trackers("tracking", config=flat_config(recipe.to_dict()))
    return True


def flat_config(tree: dict, prefix: str = "") -> dict:
    """{'lora': {'r': 8}} -> {'lora.r': 8}: trackers take scalars (TensorBoard's hparams)."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flat_config(value, f"{name}.")
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


def ddp_buckets(model) -> int:
    """Bytes of DDP's gradient buckets: its reducer's own flat copies of the gradients, which no parameter's .grad
    shares unless gradient_as_bucket_view (accelerate's default: off). They live in C++, seen through DDP's logging
    data (bucket_sizes, in bytes)."""
    if not hasattr(model, "_get_ddp_logging_data"):
        return 0
    logged = model._get_ddp_logging_data()
    if logged.get("gradient_as_bucket_view"):
        return 0
    return sum(int(b) for b in str(logged.get("bucket_sizes", "")).split(",") if b.strip())


def held_bytes(model, optimizer, beside=()) -> dict:
    """Bytes of parameters, gradients and optimizer state this process really holds right after an
    optimizer step (before zero_grad): FSDP's local shards, DeepSpeed ZeRO-3's partitions and its
    (possibly offloaded) fp32 master weights, gradients and moments, torchao's 8-bit state tensors,
    APOLLO's projection matrices, DDP's gradient buckets, and the parameters of models kept `beside` it. Each storage
    counted once. With the step in backward no gradient
    outlives its parameter's update: `gradients` is the most that was alive at once in the first backward."""
    seen: set[int] = set()

    def size(t) -> int:
        if t is None:
            return 0
        t = t.to_local() if type(t).__name__ == "DTensor" else t
        if not torch.is_tensor(t):
            return sum(map(size, vars(t).values())) if hasattr(t, "__dict__") else 0  # e.g. a projector
        if hasattr(t, "__tensor_flatten__"):  # a tensor subclass (torchao's 8-bit state): its inner tensors
            return sum(size(getattr(t, name)) for name in t.__tensor_flatten__()[0])
        if t.numel() == 0 or t.untyped_storage().data_ptr() in seen:
            return 0
        seen.add(t.untyped_storage().data_ptr())
        return t.untyped_storage().nbytes()

    def quant_scales(p) -> list:  # bitsandbytes keeps a 4-/8-bit weight's scales beside it, not as parameters
        q = getattr(p, "quant_state", None)
        nested = [q.state2.absmax, q.state2.code] if q is not None and q.nested else []
        return ([q.absmax, q.code, q.offset] if q is not None else []) + nested + [getattr(p, "SCB", None)]

    params = list(model.parameters())
    engine_optimizer = getattr(model, "optimizer", None) if hasattr(model, "zero_optimization_stage") else None
    held = params + [p for other in beside for p in other.parameters()]
    out = {"parameters": sum(size(getattr(p, "ds_tensor", p)) + sum(map(size, quant_scales(p))) for p in held)}
    # an 8-bit layer moves its weight's row scales into its own state at the first forward
    out["parameters"] += sum(size(getattr(getattr(m, "state", None), "SCB", None)) for other in (model, *beside)
                             for m in other.modules())
    inner = getattr(optimizer, "optimizer", optimizer)
    if engine_optimizer is not None and hasattr(engine_optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3
        out["gradients"] = size(getattr(engine_optimizer, "grad_partitions_flat_buffer", None))
        inner = engine_optimizer.optimizer
        state = sum(size(v) for s in inner.state.values() for v in s.values())
        out["optimizer_state"] = sum(size(t) for t in engine_optimizer.fp32_partitioned_groups_flat) + state
    else:
        peak = getattr(inner, "gradient_peak", None)  # optimizer_in_backward: measured in its hooks
        out["gradients"] = peak if peak is not None else sum(size(p.grad) for p in params)
        out["gradients"] += ddp_buckets(model)
        out["optimizer_state"] = sum(size(v) for s in inner.state.values() for v in s.values())
    # bitsandbytes' paged state (get_state_buffer: tensors of >= 1e5 elements, functional.get_paged: CUDA managed
    # memory wrapped by torch.frombuffer, marked is_paged): counted above, but invisible to the CUDA allocator, so
    # its peak (max_memory_allocated) leaves it out; said apart, to be added to that peak
    out["paged"] = sum(v.untyped_storage().nbytes() for s in inner.state.values() for v in s.values()
                       if torch.is_tensor(v) and getattr(v, "is_paged", False))
    return out


class MemorySnapshot:
    """Memory over the first steps: on CUDA the allocator's history for 3 steps (open the .pickle at
    https://pytorch.org/memory_viz); elsewhere the profiler's memory timeline by category for the
    first step (the profiler's stack tracing makes that step ~10x slower)."""

    def __init__(self, out, accelerator):
        self.out, self.rank, self.cuda = out, accelerator.process_index, accelerator.device.type == "cuda"
        self.steps, self.saved = (3 if self.cuda else 1), False
        if self.cuda:
            # python stacks only: C++ frames ("all") cost more per allocation (torch/cuda/memory.py, stacks)
            torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
        else:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                   profile_memory=True, record_shapes=True, with_stack=True)
            self.profiler.__enter__()

    def save(self) -> str:
        self.saved = True
        if self.cuda:
            path = self.out / f"memory_snapshot_rank{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            return str(path)
        self.profiler.__exit__(None, None, None)
        path = self.out / f"memory_timeline_rank{self.rank}.json"
        self.profiler.export_memory_timeline(str(path), device="cpu")
        try:  # the HTML page draws the timeline (needs matplotlib)
            self.profiler.export_memory_timeline(str(path.with_suffix(".html")), device="cpu")
        except ImportError:
            pass
        return str(path)


@dataclass
class Measured:
    """What a run measured, as its report takes it (report.build)."""

    setup: dict  # the live objects' facts (describe_setup), with the optimizer's state dtypes and offloaded bytes
    history: list[dict]  # one record per optimizer step: loss, lr, counts, seconds, grad_norm, eval_loss
    processes: list[dict]  # each process's held bytes, tokens and memory peaks
    wall_seconds: float  # this session's training loop (not the final eval and save)
    eval_loss: float | None  # on the whole eval set at the end
    eval_metrics: dict = field(default_factory=dict)  # the objective's other eval figures at the end (eval_rewards/...)


class Meter:
    """What a run measures about itself, in one object: the setup as it really is (describe_setup), each
    optimizer step's record (loss, learning rate, target/real/padded tokens over all processes, seconds; logged
    to TensorBoard / W&B when the recipe's report_to asks), what the model states hold after the first update
    (held_bytes) and the loss's peak (LossMemory), memory over the first steps (--memory-snapshot), and each
    process's peaks at the end. `finish` returns them as Measured, for the report."""

    def __init__(self, accelerator, recipe, out, model, optimizer, offload=None, snapshot: bool = False):
        self.accelerator, self.model, self.optimizer, self.offload = accelerator, model, optimizer, offload
        self.out, self.take_snapshot = out, snapshot
        self.setup = describe_setup(accelerator, model, optimizer)
        # this process's peak host RAM up to here: loading and preparing the model, before any step (under FSDP2's
        # cpu_ram_efficient_loading rank 0 alone holds the whole model)
        self.load_peak = peak_memory(torch.device("cpu"))["peak_rss_bytes"]
        self.device_use = DeviceSampler(accelerator.device)  # what the device really holds, sampled (CUDA)
        # the optimizer as the recipe chose it: how updates reach bf16 weights, what its first step costs on a GPU
        self.setup["bf16_update_rounding"] = bf16_rounding(recipe)
        # memrecipe's tiny model, trained at its own settings (registry.with_embedded_settings), not the recipe's
        self.setup["embedded_model"] = is_embedded(recipe.model_name_or_path)
        self.setup["embedded_settings"] = embedded_settings_said(recipe) if self.setup["embedded_model"] else None
        self.setup["optimizer_first_use"] = OPTIMIZERS[recipe.optim].first_use_on_cuda \
            if accelerator.device.type == "cuda" else ""
        self.tracking = start_trackers(accelerator, recipe, out)
        self.tp_share = recipe.tensor_parallel * recipe.context_parallel  # a TP group's or ring's ranks see one batch
        self.history, self.held, self.tokens, self.wall = [], None, 0, None
        self.beside = []  # models kept beside the trained one (hold)
        self.snapshot = self.loss_memory = None

    def resumed(self, state: dict) -> None:
        """A resumed run's history goes on from its checkpoint's."""
        self.history = state["history"]
        self.setup["resumed_at_step"] = state["step"]

    def hold(self, *models) -> None:
        """Models the objective keeps beside the trained one (DPO's frozen reference): their parameters are held."""
        self.beside += models

    def start(self) -> None:
        """Right before the first step: the clock, the loss's measurement and the memory snapshot start."""
        self.started = time.perf_counter()
        self.snapshot = MemorySnapshot(self.out, self.accelerator) if self.take_snapshot else None
        self.loss_memory = LossMemory(self.model, self.accelerator.device)  # on the first micro batch

    def updated(self) -> None:
        """After an optimizer step, before zero_grad: the first time, what this process really holds, once the
        optimizer state exists."""
        if self.held is not None:
            return
        self.held = held_bytes(self.model, self.optimizer, self.beside)
        self.held["logits"] = self.loss_memory.bytes
        self.setup["optimizer_state_dtypes"] = optimizer_state_dtypes(self.optimizer)
        if self.offload is not None:  # activation offload: what one micro batch's checkpoints kept on the host
            self.setup["offloaded_bytes_per_micro_batch"] = self.offload.bytes // self.accelerator.gradient_accumulation_steps

    def record(self, step: int, window: list[dict], loss: float, targets: int, lr: float, started: float,
               grad_norm=None, evaluated: dict | None = None, metrics: dict | None = None) -> dict:
        """The step's record, kept in the history and logged to the trackers: with the objective's own metrics
        (e.g. preference tuning's rewards/...) and an eval's ({"eval_loss": ..., "eval_rewards/...": ...})."""
        reduce = lambda t: self.accelerator.reduce(t.to(self.accelerator.device), "sum")  # noqa: E731
        counts, local = window_counts(window, targets, reduce, self.tp_share)  # each batch once
        self.tokens += local
        record = {"step": step, "loss": loss, **counts, "lr": lr, "seconds": time.perf_counter() - started}
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        record.update(metrics or {})
        record.update(evaluated or {})
        self.history.append(record)
        if self.tracking:
            self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=step)
        if self.snapshot is not None and step == self.snapshot.steps:
            self.snapshot.save()
        return record

    def stop(self) -> None:
        """The training loop is over: its clock stops (the final eval and save are not training)."""
        self.wall = time.perf_counter() - self.started

    def finish(self, eval_loss: float | None, evaluated: dict | None = None) -> Measured:
        """Every process's figures, gathered (a collective: every process calls it), after the final save."""
        from accelerate.utils import gather_object

        if self.held is None:  # a resume from the last step's checkpoint trains no step: held as it was loaded
            self.held = held_bytes(self.model, self.optimizer, self.beside) | {"logits": None}
        processes = gather_object([{"process_index": self.accelerator.process_index,
                                    "num_processes": self.accelerator.num_processes, "held": self.held,
                                    "tokens": self.tokens, "load_peak_rss_bytes": self.load_peak,
                                    # CUDA: the allocator's peak before the loss's window reset it (loading's own)
                                    "cuda_peak_before_training_bytes": getattr(self.loss_memory, "before_peak", None),
                                    "cuda_device_used_peak_bytes": self.device_use.stop(),
                                    **peak_memory(self.accelerator.device)}])
        if self.snapshot is not None and not self.snapshot.saved:
            self.snapshot.save()
        return Measured(self.setup, self.history, processes, self.wall, eval_loss,
                        {k: v for k, v in (evaluated or {}).items() if k != "eval_loss"})
