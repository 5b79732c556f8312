"""What tests measure a model by: the bytes it holds and the tensors autograd saves, on the batches the recipes
build (shared by the planner's tests, which hold the estimate to these measurements). The forward runs under the
loop's autocast: bf16, without autocast's weight cache (training.accelerator)."""

import gc
import weakref

import torch

from helpers import loop_model
from memrecipe.planning.architecture import read_config, structure
from memrecipe.planning.registry import load_recipe
from memrecipe.training.loss import lm_loss


def batch(vocab, b=2, s=48):
    """Rows packed as the recipes pack them (packing: true): three documents each, positions restarting at 0."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    positions = torch.cat([torch.arange(n) for n in (s // 3, s // 3, s - 2 * (s // 3))]).repeat(b, 1)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids), "position_ids": positions}


def real_model_state_bytes(model, optimizer):
    """Bytes really held after an optimizer step: parameters, their .grad, the optimizer's state
    tensors; each storage once (bitsandbytes shares its quantisation maps between parameters)."""
    def total(tensors):
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if torch.is_tensor(t)}
        return sum(storages.values())

    params = list(model.parameters())
    inner = getattr(optimizer, "optimizer", optimizer)
    state = [v for s in inner.state.values() for v in s.values()]
    return total(params), total(p.grad for p in params if p.grad is not None), total(state)


def saved_at_forward_end(model, b, autocast) -> int:
    """Bytes of the tensors autograd keeps for backward when the forward ends (each storage once, parameters left
    out); the backward then runs."""
    bytes_at_end = []
    saved_peak(model, b, autocast, at_forward_end=bytes_at_end)
    return bytes_at_end[0]


def saved_peak(model, b, autocast, at_forward_end=None):
    """Peak bytes of tensors autograd keeps for backward, over the forward and the backward (including
    gradient checkpointing's recompute), each storage counted once, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    live, now = {}, [0, 0]

    class Held:
        __slots__ = ("tensor", "__weakref__")

    def release(ptr):
        live[ptr][0] -= 1
        if live[ptr][0] == 0:
            now[0] -= live.pop(ptr)[1]

    def pack(t):
        held = Held()
        held.tensor = t
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            if ptr in live:
                live[ptr][0] += 1
            else:
                live[ptr] = [1, t.untyped_storage().nbytes()]
                now[0] += live[ptr][1]
                now[1] = max(now[1], now[0])
            weakref.finalize(held, release, ptr)
        return held

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast, cache_enabled=False):
            loss = lm_loss(model, b)
        if at_forward_end is not None:
            at_forward_end.append(now[0])
        loss.backward()
    return now[1]


def activation_case(models, name, recipe, overrides, layers=None):
    r = load_recipe(recipe, [*overrides, "per_device_train_batch_size=2", "max_seq_length=48"])
    precision = "no" if r.mixed_precision == "no" else "bf16"
    folder = models[name]
    if layers is not None:  # the same model cut to `layers` decoder layers
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(folder)
        config.num_hidden_layers = layers
        folder = models["dir"] / f"{name}-{layers}"
        if not folder.exists():
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        folder = str(folder)
    model, _ = loop_model(r, folder, precision)  # the head fused as the recipe says
    if r.attn_implementation == "eager":
        model.config._attn_implementation = "eager"
    model.train()
    measured = saved_peak(model, batch(model.config.vocab_size), autocast=precision == "bf16")
    s = structure(read_config(folder))
    from memrecipe.planning.activations import activation_bytes, activation_mode

    return measured, activation_bytes(r, s, activation_mode(r, 2 if precision == "bf16" else 4), 2, 48)



def held_after_forward(model, b, autocast) -> tuple[float, int, dict]:
    """(loss, bytes allocated by the forward and still held when it ends, the gradients after backward): what a
    checkpointing mode keeps between forward and backward, read off the CPU profiler's allocations."""
    gc.collect()  # a collection inside the profile would free what earlier work allocated: net bytes below zero
    gc.disable()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast, cache_enabled=False):
                loss = lm_loss(model, b)
    finally:
        gc.enable()
    held = sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    loss.backward()
    return loss.item(), held, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def step_peak(model, b, autocast) -> int:
    """The most bytes held at once over a training step (forward and backward) beside the parameters and their
    gradients: what the plan's working activations count, read off the CPU profiler's memory timeline."""
    return profiled_peak(lambda: _step(model, b, autocast), model.parameters())


def _step(model, b, autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast, cache_enabled=False):
        loss = lm_loss(model, b)
    loss.backward()


def allocation_peak_of(step) -> int:
    """The most bytes `step()`'s own allocations held at once: the CPU profiler's allocation
    events, each free matched to its allocation by address, so that what was allocated before the window and freed
    inside it does not count (in a full run such frees, different from one run to the next, read an optimizer
    step's peak 4-16% low); the garbage collector off, as every profiled window here must be."""
    return allocation_peaks_of([step])[0]


def kernels_own(step):
    """`step` with the CPU's bf16 GEMMs as torch's own loops, not oneDNN's: on a CPU with AVX-512 (where torch's bf16
    GEMM is oneDNN's) each GEMM packs its operands in scratch it takes from torch's allocator and frees before it
    returns (up to ~170 KB a thread at the shapes measured here), where on an AVX2 CPU it runs in place. That is the
    BLAS's workspace, as MKL's for fp32 GEMMs is (which torch's allocator never sees): what a kernel's own bytes are
    held to here leaves it out on every CPU alike. Slower: for small shapes only."""
    def run():
        with torch.backends.mkldnn.flags(enabled=False):
            return step()
    return run


def allocation_peaks_of(steps) -> list[int]:
    """allocation_peak_of for each of `steps`, called in turn in one profiled window (a window costs ~0.25 s: one
    per step of each of 39 tensors made a test 20 s long): each step's own allocations are those of its own range."""
    gc.collect()
    gc.disable()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            for n, step in enumerate(steps):
                with torch.profiler.record_function(f"measured-step-{n}"):
                    step()
    finally:
        gc.enable()
    ranges = {int(event.name.removeprefix("measured-step-")): event
              for event in _under(prof.profiler.kineto_results.experimental_event_tree())
              if event.name.startswith("measured-step-")}
    return [_peak(ranges[n]) for n in range(len(steps))]


def _under(roots):
    """Every event of the profiler's event tree from `roots` down."""
    stack = list(roots)
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        yield event


def _peak(range_event) -> int:
    """The most bytes the allocations under `range_event` held at once (frees of anything older left out)."""
    from torch._C._profiler import _EventType

    allocations = [(e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size) for e in _under([range_event])
                   if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"]
    live, now, peak = set(), 0, 0
    for _, address, size in sorted(allocations):
        if size > 0 or address in live:
            (live.add if size > 0 else live.discard)(address)
            now += size
            peak = max(peak, now)
    return peak


def profiled_peak(step, parameters=None) -> int:
    """The most bytes `step()` holds at once beside the parameters and their gradients, above what was held before it
    (the CPU profiler's memory timeline). Given the model's `parameters`, only their gradients are left out, not
    other leaves' (only_parameters_gradients): the step must leave their .grad set."""
    from torch.profiler._memory_profiler import Category, MemoryProfileTimeline, _CATEGORY_TO_INDEX

    gc.collect()
    gc.disable()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                    record_shapes=True, with_stack=True) as prof:  # (what the timeline needs)
            step()
    finally:
        gc.enable()
    profile = prof._memory_profile()
    if parameters is not None:
        only_parameters_gradients(profile, parameters)
    _, sizes = MemoryProfileTimeline(profile)._coalesce_timeline("cpu")
    states = [1 + _CATEGORY_TO_INDEX[c] for c in (Category.PARAMETER, Category.GRADIENT)]
    held = [sum(size) - sum(size[i] for i in states) for size in sizes]
    return max(held) - held[0]


def only_parameters_gradients(profile, parameters) -> None:
    """Counts as held the gradients of leaves that are not parameters: the profiler calls any tensor autograd
    accumulates into a GRADIENT, also the input's gradient the tiled MLP's backward gathers in one tensor
    (training.tiling.TiledMLP), which is working memory the plan counts. A parameter's gradient is the last tensor
    allocated where its .grad lies after the step."""
    from torch.profiler._memory_profiler import Category

    addresses = {p.grad.untyped_storage().data_ptr() for p in parameters if p.grad is not None}
    elements = [e for e in profile._categories._values.values() if e.by_id == Category.GRADIENT]
    last = {}  # address -> the latest allocation there
    for element in elements:
        for key in element._by_id_keyset:
            if key.storage.ptr in addresses:
                last[key.storage.ptr] = max(last.get(key.storage.ptr, -1), key.storage.allocation_id)
    for element in elements:
        if not any(last.get(k.storage.ptr) == k.storage.allocation_id for k in element._by_id_keyset):
            element.by_id = None


# ops that are not elementwise work: the matmuls, the attention kernels (each counted apart by the forecast)
NOT_ELEMENTWISE = ("mm", "bmm", "addmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
                   "_scaled_dot_product_flash_attention_for_cpu_backward")


# ops that allocate without touching memory, and in-place ops that write their first argument without reading it
ALLOCATE = ("empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided")
WRITE_ONLY = ("copy_", "fill_", "zero_", "bernoulli_", "uniform_", "normal_")


def ops_counted(step, weigh=lambda func, args, kwargs, out: 1) -> int:
    """`weigh(func, args, kwargs, out)` summed over the torch ops `step()` dispatches (1 each: the ops, each a kernel
    launch on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.total += weigh(func, args, kwargs or {}, out)
            return out

    with Count():
        step()
    return Count.total


def elementwise_bytes_moved(step) -> int:
    """Bytes the ops of `step()` read and write, but the matmuls', attention's and the views' (which move nothing):
    each tensor argument's and output's own bytes (a broadcast one's storage, not its expanded size); an allocation
    moves nothing, and a write-only in-place op (copy_ into a buffer) does not read what it overwrites."""
    from torch.utils._pytree import tree_flatten

    def size(t):
        return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())

    def moved(func, args, kwargs, out):
        name = func.overloadpacket.__name__
        view = name == "_unsafe_view" or any(r.alias_info is not None and not r.alias_info.is_write
                                             for r in func._schema.returns)
        if view or name in NOT_ELEMENTWISE or name in ALLOCATE:
            return 0
        read = args[1:] if name in WRITE_ONLY else args
        return sum(size(t) for t in tree_flatten((read, kwargs, out))[0] if isinstance(t, torch.Tensor))

    return ops_counted(step, moved)


def dropout_draws_made(step) -> int:
    """Random numbers the dropouts of `step()` draw (a CPU's dropout fills a noise tensor with bernoulli_; CUDA's
    fused native_dropout draws its input's numel)."""
    return ops_counted(step, lambda func, args, kwargs, out: args[0].numel() if func.overloadpacket.__name__ in (
        "bernoulli_", "bernoulli", "native_dropout") else 0)
