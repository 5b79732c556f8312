"""Memory probes: what this process really holds (held_bytes), its peaks (peak_memory, DeviceSampler), what the loss
adds (LossMemory, allocation_peak), memory over the first steps (MemorySnapshot), and where a step's time goes
(StepProfile). The Meter (meter.py) runs them."""

from __future__ import annotations

import gc
import resource
import sys
import time

import torch


def optimizer_state_dtypes(optimizer) -> list[str]:
    """The dtypes of the optimizer's state tensors (8-bit bitsandbytes state shows as uint8)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    state = getattr(inner, "state", {})
    # torchao's 8-bit state shows its float dtype outside; its codes are what it stores
    stored = [getattr(v, "codes", v) for s in state.values() for v in s.values() if torch.is_tensor(v)]
    return sorted({str(v.dtype).removeprefix("torch.") for v in stored if v.numel() > 1})


def peak_memory(device) -> dict:
    """Peak memory of this process: CUDA allocator peaks on GPU, peak RSS always (bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"peak_rss_bytes": rss if sys.platform == "darwin" else rss * 1024}
    if device.type == "cuda":
        out |= {"cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device)}
        # pinned host memory as torch's CachingHostAllocator holds it (DeepSpeed's offload buffers: blocks below
        # pinned_max_cached_size_mb rounded up to a power of two, planning.states.host_block), beside the activation
        # offload's registered arena (offload_host_bytes): what the plan's pinned host figure must cover
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
            def used() -> int:
                free, total = torch.cuda.mem_get_info(device)
                return total - free
            read = used
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
    optimizer step (before zero_grad): FSDP's local shards, DeepSpeed ZeRO-3's partitions, its reduce buckets and its
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
            return sum(size(getattr(t, name)) for name in t.__tensor_flatten__()[0])  # pyright: ignore[reportAttributeAccessIssue]
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
        out["gradients"] = size(getattr(engine_optimizer, "grad_partitions_flat_buffer", None)) + sum(
            size(bucket.buffer) for bucket in getattr(engine_optimizer, "ipg_buckets", {}).values()) + sum(
            size(t.grad) for t in engine_optimizer.fp32_partitioned_groups_flat)  # reduce buckets; offloaded, the
        # fp32 gradient each sub group keeps for CPU Adam (stage3.py initialize_optimizer_states)
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
            # python stacks only: C++ frames ("all") cost more per allocation (torch/cuda/memory.py, stacks). The last
            # million events: a tiled long-context step makes far more than 100,000 (the fourth lease's 751K-token
            # row kept only the step's end), and a window that begins mid-step hides what was made before it; the
            # cost is host memory, a few hundred bytes an event
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
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


def kernel_seconds(events) -> float:
    """Seconds the device's kernels ran, from the profiler's averages: the kernels' own events (as torch's table sums
    its "Self CUDA time total"), not the ops that launched them, which carry the same time again."""
    return sum(e.self_device_time_total for e in events
               if e.device_type != torch.autograd.DeviceType.CPU and not e.is_user_annotation) / 1e6


class StepProfile:
    """Where one step's time goes (--profile): a run's second optimizer step (the first is warm-up: caches, compiles)
    under torch's profiler, a GPU's kernels too. Writes profile_rank{R}.json, a Chrome trace (https://ui.perfetto.dev),
    and profile_rank{R}.txt: the ops by their own time on the device (on CPU, by their own CPU time) and, on a GPU,
    how much of the step's wall time its kernels took (the rest: gaps between kernels, the host's launches and
    waits)."""

    ROWS = 25

    def __init__(self, out, accelerator):
        self.out, self.rank, self.cuda = out, accelerator.process_index, accelerator.device.type == "cuda"
        self.profiler, self.path, self.step, self.started = None, None, 0, 0.0

    def begin(self, step: int) -> None:
        self.step = step
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda
                                                             else [])
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profiler.__enter__()
        self.started = time.perf_counter()

    def end(self) -> str:
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started
        self.profiler.__exit__(None, None, None)
        events = self.profiler.key_averages()
        key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        lines = [f"step {self.step}: {wall:.3f} s of wall time, process {self.rank}"]
        if self.cuda:
            busy = kernel_seconds(events)
            lines.append(f"the GPU's kernels: {busy:.3f} s ({busy / wall:.0%} of the step); gaps between them: "
                         f"{max(wall - busy, 0):.3f} s")
        lines.append(events.table(sort_by=key, row_limit=self.ROWS, max_name_column_width=60))
        self.path = self.out / f"profile_rank{self.rank}.txt"
        self.path.write_text("\n".join(lines) + "\n")
        self.profiler.export_chrome_trace(str(self.out / f"profile_rank{self.rank}.json"))
        return str(self.path)
