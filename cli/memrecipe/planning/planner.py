"""How much memory a recipe needs, per process and per machine, before anything is launched, and what fits.

Pure Python: Recipe x Structure (from config.json) x Topology -> Estimate (model states: states.py; activations:
activations.py), judged against a GPU and a host (Verdict), and the pick of what fits (recommend). Every formula, with its
source and what it leaves out, is in docs/memory.md. Activations are counted the way PyTorch
saves tensors for backward in transformers' Llama-family layers (measured on CPU, see the tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import RecipeError
from ..units import GiB
from .activations import activation_mode, plan_attention, residual_bytes
from .architecture import Structure
from .attention import mask_window, square_bytes, square_note
from .forecast import REFERENCE, Rates, cpu_rates, forecast
from .hardware import cpu_flags
from .nccl import nccl_bytes
from .recipe import METHODS, Recipe, method
from .states import (Sizes, add_reference, engine_states, loading_bytes, optimizer_state_bytes, step_temporaries,
                     trainable_tensors, weight_bytes)
from .topology import Topology, check_supported, resolve_precision

GPU_OVERHEAD = 1 * GiB  # CUDA context, kernels, cuBLAS workspaces, allocator slack (NCCL's buffers: planning.nccl)
CPU_OVERHEAD = GiB // 2  # per process on CPU: torch, transformers, accelerate, DeepSpeed (measured RSS ~0.45 GiB)
TIE = 0.05  # forecast tokens/s this close to the fastest's are a tie in the recommendation
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
    host_offload: int  # bytes per machine of host RAM for offloaded state
    cpu: bool
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
    refused: str | None = None  # why it cannot run whatever the memory (the attention kernel's 32-bit offsets)
    trainable: int = 0  # parameters trained (all processes'), for the step-time forecast's optimizer step
    step_seconds: float = 0.0  # the forecast (planning.forecast): one optimizer step, per process
    nccl: int = 0  # of `overhead`: NCCL's buffers on the GPU, outside torch's allocator (planning.nccl)
    tokens_per_second: float = 0.0  # ... and the tokens all processes train a second
    forecast_on: str = ""  # the device whose rates it is at
    # of `host_offload`, what is page-locked on a GPU box (torch's pinned allocator's blocks, the activation offload's
    # registered arena); 0 on CPU
    host_pinned: int = 0
    stream_bytes: int = 2  # bytes an element of the residual stream (planning.activations.residual_bytes)
    redraws_dropout: bool = False  # LoRA's adapters redraw their dropout in backward (Recipe.redraws_dropout)

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
                                             *CATEGORIES, "host_offload", "host_load", "cpu", "step_seconds", "tokens_per_second",
                                             "forecast_on", "saved_peak", "host_pinned",
                                             "working", "step", "attention", "nccl", "gathered_params",
                                             "gathered_grads", "refused", "redraws_dropout")}
        return out | {"total": self.total, "host_total": self.host_total(), "notes": list(self.notes)}


def as_it_runs(recipe: Recipe, s: Structure) -> tuple[Recipe, list[str]]:
    """The recipe as the loop runs it on this model, and what differs said: lean_norms replaces Llama's RMSNorm only
    (the norms of other kinds stay as they are, and are planned so)."""
    if recipe.lean_norms and not s.lean_norms_apply:
        return replace(recipe, lean_norms=False), [f"lean_norms: {s.model_type}'s RMSNorm is not Llama's (Gemma's adds "
                                                   "1 to its weight), so it is left as it is: planned without"]
    return recipe, []


def check_plannable(recipe: Recipe, s: Structure) -> None:
    """Refuses, with the reason, what the planner does not plan on a mixture of experts."""
    if s.experts and recipe.quantization is not None:
        share = sum(g.layers * g.expert_params for g in s.groups()) / s.params
        raise RecipeError(f"QLoRA saves little on {s.model_type}, whose experts ({share:.0%} of its parameters) are fused "
                          "tensors that stay in 16 bits (bitsandbytes quantizes nn.Linear layers only): use a LoRA "
                          "recipe (single-gpu-lora, fsdp-lora), with lora.dropout=0")
    if s.experts and recipe.gradient_checkpointing == "selective":
        raise RecipeError(f"gradient_checkpointing: selective is planned for dense models; {s.model_type} routes "
                          "tokens to experts, whose kernels it would keep unplanned: use gradient_checkpointing=true")


def estimate(recipe: Recipe, s: Structure, topo: Topology, micro_batch: int | None = None,
             seq_length: int | None = None, attention: str | None = None, rates: Rates | None = None) -> Estimate:
    """Memory per process and per machine for this recipe, model and topology, and the step time forecast at
    `rates` (None: the CPU's in CPU mode, else the reference GPU's). `attention`: the kernel that ran (a run's
    report); None plans the one a launch here would pick."""
    check_plannable(recipe, s)
    recipe, said = as_it_runs(recipe, s)
    batch, seq = micro_batch or recipe.per_device_train_batch_size, seq_length or recipe.max_seq_length
    sp = recipe.sequence_group(topo.num_processes)
    precision = resolve_precision(recipe, topo)
    compute_bytes = 2 if precision in ("bf16", "fp16") else 4
    train = trainable_tensors(recipe, s)
    trained = sum(t.numel for t in train)
    weights = weight_bytes(recipe) if recipe.lora is None else 4  # LoRA's adapters train in fp32
    z = Sizes(s.params, trained, compute_bytes, weights, optimizer_state_bytes(recipe, train, weights),
              topo.num_processes, topo.num_machines, topo.cpu)
    states = engine_states(recipe, s, z, train)
    add_reference(recipe, s, z, states)
    notes = states.notes + said
    load = loading_bytes(recipe, s, compute_bytes, z.local)
    step = step_temporaries(recipe, train, weights)  # (the model states' side: asked here, with the rest of them)
    if load and not topo.cpu:
        notes.append(f"loading holds {load / GiB:.1f} GiB of host RAM per machine before the model is on the GPUs")
    mode = activation_mode(recipe, compute_bytes)
    stream = residual_bytes(mode)
    attention, act, wraps = plan_attention(recipe, s, mode, compute_bytes == 2, batch, seq, sp, topo.cpu, attention,
                                           notes)
    square = square_note(attention, max(square_bytes(attention, recipe.packing, batch, seq, s.heads, compute_bytes == 4,
                                                      mask_window(recipe.query_chunks, g.window))
                                     for g in s.groups()), seq)
    if square:  # long context on a kernel that keeps [S x S] tensors: say which kernels keep none
        notes.append(square)
    # the step's temporaries: after backward (the activations gone), or inside it, beside the checkpointed inputs
    working = max(act["working"], step + (act["forward_saved"] if recipe.optimizer_in_backward else 0))
    if step:
        notes.append(f"the optimizer's step allocates {step / GiB:.1f} GiB of temporaries at its largest tensor")
    if act["host"]:  # (pinned on a GPU box: layers.HostArena registers its block)
        states.add_host(act["host"] * z.local, pinned=not topo.cpu)
        notes.append("activation offload: each layer's checkpointed input waits in host memory")
    if topo.cpu:
        notes.append("CPU smoke-test mode: every figure is host RAM")
    nccl = 0 if topo.cpu else nccl_bytes(z.processes, z.machines, sp, recipe.context_parallel, recipe.tensor_parallel)
    if nccl:
        notes.append(f"NCCL's buffers: {nccl / GiB:.1f} GiB a GPU beside the allocator's (its communicators' "
                     "channels on an NVSwitch machine: docs/memory.md)")
    est = Estimate(
        recipe=recipe.name, processes=z.processes, machines=z.machines, micro_batch=batch, seq_length=seq,
        parameters=int(states.params), gradients=int(states.grads), optimizer_state=int(states.optimizer),
        activations=int(act["activations"]), logits=int(act["logits"]),
        overhead=CPU_OVERHEAD if topo.cpu else GPU_OVERHEAD + nccl, nccl=nccl, host_offload=int(states.host),
        host_pinned=states.pinned, cpu=topo.cpu,
        saved_peak=int(act["saved_peak"]), working=int(working),
        host_load=int(load), notes=tuple(notes), step=int(step), attention=attention, refused=wraps,
        gathered_params=int(states.gathered_params), gathered_grads=int(states.gathered_grads), trainable=trained,
        stream_bytes=stream, redraws_dropout=recipe.redraws_dropout)
    f = forecast(recipe, s, est, rates or (cpu_rates(cpu_flags()) if topo.cpu else REFERENCE), precision)
    return replace(est, step_seconds=f.step_seconds, tokens_per_second=f.tokens_per_second, forecast_on=f.device)


@dataclass(frozen=True)
class Verdict:
    estimate: Estimate
    device_capacity: int | None  # bytes per process (GPU memory; None in CPU mode)
    host_capacity: int | None  # bytes per machine

    @property
    def device_fits(self) -> bool:
        return self.estimate.refused is None and (self.device_capacity is None or
                                                  self.estimate.total <= self.device_capacity)

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
        return min(known, key=lambda name: known[name]) if known else None


def judge(est: Estimate, gpu_memory: int | None, host_memory: int | None) -> Verdict:
    return Verdict(est, None if est.cpu else gpu_memory, host_memory)


def decide_dropout(recipe: Recipe, s: Structure, topo: Topology, gpu_memory, host_memory, micro_batch: int | None = None,
                   seq_length: int | None = None, rates: Rates | None = None) -> tuple[Recipe, Verdict]:
    """The recipe with `lora.redraw_dropout: auto` decided by the memory, and its verdict: peft's dropout (`false`:
    each adapter keeps its mask and 16-bit dropped input, planned) where the step fits with it, the redraw (`true`:
    each adapter keeps only its input) where only the redraw fits or nothing does. peft's is never slower: one pass
    fewer of each adapter's cast and dropout in backward and no checkpoint of its own (0.81-0.90x the redrawn step
    on CPU, docs/speed.md; on a launch-bound GPU step, fewer kernels and less host time). Any other value is judged
    as it is; so is a recipe whose adapters have no dropout, or keep peft's anyway (fp32, compiled layers), decided
    `false` where nothing is redrawn either way."""
    def judged(r: Recipe) -> Verdict:
        return judge(estimate(r, s, topo, micro_batch, seq_length, rates=rates), gpu_memory, host_memory)

    lora = recipe.lora
    if lora is None or lora.redraw_dropout != "auto":
        return recipe, judged(recipe)
    kept, redrawn = (replace(recipe, lora=replace(lora, redraw_dropout=value)) for value in (False, True))
    if not redrawn.redraws_dropout:  # nothing is redrawn either way (no dropout; fp32 or compiled layers)
        return kept, judged(kept)
    verdict = judged(kept)
    if verdict.fits:
        return kept, verdict
    v = judged(redrawn)
    if not v.fits:
        return redrawn, v
    e = v.estimate
    why = (f"lora.redraw_dropout: auto redraws the adapters' dropout in backward for {e.recipe}: with peft's (each "
           f"adapter its mask and dropped input kept) it would need {verdict.estimate.total / GiB:.1f} GiB a process")
    return redrawn, replace(v, estimate=replace(e, notes=(*e.notes, why)))


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
    """The fastest recipe that fits (the forecast's tokens/s),
    and why, with the host RAM it needs; or, if none fits, what binds (the GPUs, or the host RAM of those
    the GPUs would hold), what comes closest and the remedy for that."""
    fitting = [v for v in verdicts if v.fits]
    if fitting:
        # forecasts within TIE of the fastest are not told apart (the forecast's own error is larger): of those, the
        # one that changes the recipe least (a planned name is NAME+RUNG where it climbed), then the fastest
        fastest = max(v.estimate.tokens_per_second for v in fitting)
        best = min((v for v in fitting if v.estimate.tokens_per_second >= (1 - TIE) * fastest),
                   key=lambda v: (v.estimate.recipe.count("+"), -v.estimate.tokens_per_second))
        e = best.estimate
        where = "per CPU process" if e.cpu else "per GPU"
        spare = f", {best.headroom / GiB:.1f} GiB to spare" if best.headroom is not None else ""
        host = ("" if e.cpu else f"; host RAM {e.host_total() / GiB:.1f} GiB per machine"
                + ("" if best.host_capacity is not None else " (not checked: give --host-memory)"))
        return best, (f"{e.recipe}: the fastest recipe that fits ({e.tokens_per_second:,.0f} tokens/s forecast on "
                      f"{e.forecast_on}), "
                      f"{e.total / GiB:.1f} GiB {where}{spare}{host}")
    if not verdicts:
        return None, "no recipe runs on this topology"
    if all(v.estimate.refused for v in verdicts):  # whatever the memory: say why, not what is short
        return None, f"nothing can run: {verdicts[0].estimate.recipe}: {verdicts[0].estimate.refused}"
    verdicts = [v for v in verdicts if not v.estimate.refused]
    on_device = [v for v in verdicts if v.device_fits]
    if on_device:  # the GPUs would hold these: the host RAM is what binds
        least = min(on_device, key=lambda v: v.estimate.host_total())
        return None, (f"nothing fits in host RAM: the least is {least.estimate.recipe} at "
                      f"{least.estimate.host_total() / GiB:.1f} GiB per machine, more than "
                      f"{least.host_capacity / GiB:.1f}; give the machines more host RAM, use more machines (each "
                      "holds its own processes' share), or train another way (LoRA, QLoRA)")
    least = min(verdicts, key=lambda v: v.estimate.total)
    e = least.estimate
    remedies = ["use more GPUs" + (" (sequence parallelism splits each sequence over them)" if e.seq_length >= 32768
                                   else ""), "a shorter max_seq_length"]
    if e.micro_batch > 1:  # (advice that changes something: at 1 there is no smaller micro batch)
        remedies.append("per_device_train_batch_size=1")
    return None, (f"nothing fits on the GPUs: the least is {e.recipe} at {e.total / GiB:.1f} GiB per process; "
                  + ", ".join(remedies[:-1]) + f" or {remedies[-1]}")


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
               global_batch: int | None = None, rates: Rates | None = None
               ) -> tuple[list[tuple[Recipe, Verdict, str]], list[tuple[str, str]]]:
    """Every recipe planned on this topology and judged against these memories (`plan`, and a refused run's
    pick of what would fit instead): ([(recipe, verdict, batch note)], [(recipe name, why it cannot be
    planned)]). `shapes`: model_name_or_path -> Structure. With `global_batch`, each recipe at the largest
    micro batch that fits, with the accumulation that makes up the global batch; `lora.redraw_dropout: auto` decided
    there (decide_dropout). `rates`: the forecast's (None: the reference GPU's, or the CPU's)."""
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
            r, verdict = decide_dropout(r, s, topo, gpu_memory, host_memory, rates=rates)
            rows.append((r, verdict, note))
        except RecipeError as e:  # a topology it does not support, or a model it cannot train (with the reason)
            skipped.append((r.name, str(e)))
    return rows, skipped
