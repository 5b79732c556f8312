"""A run's setup as it really is, read off the live objects (how the model is wrapped, what runs where): one typed
record, said by the loop's start-up lines and kept in report.json's "setup". Torch is imported by `describe_setup`
alone, so the report reads a finished run's facts without it."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields

from ..planning.rungs import LADDER

# accelerate's distributed types, in words for the start-up line
ENGINES = {"NO": "plain (no DDP/FSDP/DeepSpeed)", "MULTI_CPU": "DDP (gloo)", "MULTI_GPU": "DDP", "FSDP": "FSDP",
           "DEEPSPEED": "DeepSpeed"}


@dataclass
class SetupFacts:
    """What a test (or a user) checks to see the recipe really took effect. Every field has a default: a report.json
    written by an older memrecipe lacks the newer ones (`from_dict`)."""

    distributed_type: str = "NO"
    engine: str = ""
    num_processes: int = 1
    process_index: int = 0
    device: str = "cpu"
    mixed_precision: str = "no"
    model_class: str = ""
    fsdp2_modules: int = 0
    dtensor_params: int = 0
    params: int = 0
    trainable_params: int = 0
    quantized_weights: int = 0  # bitsandbytes weights (Params4bit/Int8Params): their params are the packed storage's
    trainable_names_all_lora: bool = False
    optimizer_class: str = ""
    optimizer_in_backward: bool = False
    optimizer_compile_seconds: float = 0.0  # spent compiling the step before step 1 (torchao on CUDA)
    gradient_checkpointing: bool | str = False  # the loop's (training.layers): True, "selective", or False
    engine_checkpointed_layers: int = 0  # layers checkpointed by the engine's wrapper (fsdp.activation_checkpointing)
    tiled_mlps: int = 0  # MLPs running in tiles of tokens (training.tiling)
    lean_norms: int = 0  # RMSNorms keeping their inputs (training.norms)
    query_chunk: int = 0  # queries per call of sdpa's kernel in a row without a mask (training.query_chunks; 0: all)
    lora_shared_inputs: int = 0  # LoRA layers whose adapters read their input as it comes (adapters.share_inputs)
    lora_recomputed_dropout: int = 0  # adapters whose dropout runs in a checkpoint of its own (adapters)
    attention: str | None = None  # the kernel transformers runs (training.loading.attention: auto resolved)
    attention_why: str | None = None
    bf16_matmuls_in_fp32: bool = False  # where the CPU has no bf16 GEMM (training.cpu_matmul)
    cpu_threads: int = 0  # what CPU work (DeepSpeed's CPU Adam, collation) runs on
    allocator_conf: str | None = None  # the CUDA allocator's environment (memrecipe/__init__.py sets one)
    allocator_expandable_segments: bool | None = None  # ... and what it applied, read off its segments (CUDA)
    sequence_parallel: int = 1  # the engine's Ulysses group (1: none)
    ulysses_attention: bool = False  # transformers' attention runs through DeepSpeed's Ulysses wrapper
    context_parallel: int = 1  # ring attention's group, as accelerate prepared it (1: none)
    # a DeepSpeed engine's (None elsewhere)
    zero_stage: int | None = None
    zero_offload_optimizer: bool | None = None
    zero_offload_param: bool | None = None
    client_optimizer_class: str | None = None
    # the recipe's, said beside them (the Meter's)
    bf16_update_rounding: str | None = None  # how updates reach bf16 weights (planning.optimizers.bf16_rounding)
    embedded_model: bool = False  # memrecipe's tiny model, trained at its own settings
    embedded_settings: str | None = None
    optimizer_first_use: str = ""  # what the optimizer's first step costs on a GPU
    # learned as the run goes (the Meter's)
    resumed_at_step: int = 0
    optimizer_state_dtypes: list[str] = field(default_factory=list)
    offloaded_bytes_per_micro_batch: int | None = None  # activation offload: one micro batch's checkpoints on the host

    @classmethod
    def from_dict(cls, facts: dict) -> SetupFacts:
        """report.json's "setup" back (keys it does not know are an older or newer memrecipe's: left out)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in facts.items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)

    def activations(self, recipe) -> str:
        """The start-up line's words for what the activations keep: each rung's the recipe stands on (its phrase in
        planning/rungs.py), then what the LoRA adapters share."""
        said = [phrase for technique in LADDER if (phrase := technique.phrase(self, recipe))]
        lora = (f"{self.lora_shared_inputs} LoRA layers' adapters share their inputs" if self.lora_shared_inputs else "") \
            + (f", {self.lora_recomputed_dropout} redraw their dropout in backward" if self.lora_recomputed_dropout else "")
        kept = recipe.lora and recipe.lora.dropout and recipe.keeps_dropout  # (lora.redraw_dropout false, or decided so)
        return "; ".join(said + [part for part in (lora, "LoRA's dropout as peft's (each adapter keeps its mask)" if kept
                                                   else "") if part])


def describe_setup(accelerator, model, optimizer) -> SetupFacts:
    """The facts read off the live objects (the Accelerator, the prepared model and optimizer)."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from .. import ALLOCATOR_CONF
    from . import cpu_matmul, query_chunks
    from .norms import lean_forward
    from .ring import Ring
    from .tiling import tiled_forward

    params = list(model.parameters())
    inner = getattr(optimizer, "optimizer", optimizer)  # (accelerate's AcceleratedOptimizer wraps it)
    unwrapped = accelerator.unwrap_model(model)

    def numel(p) -> int:  # ZeRO-3 partitions hold ds_numel; a packed 4-bit weight knows its real shape
        q = getattr(p, "quant_state", None)
        return q.shape.numel() if q is not None else getattr(p, "ds_numel", p.numel())

    attention = getattr(getattr(unwrapped, "config", None), "_attn_implementation", None)
    chunk = max((getattr(m, "query_chunk", 0) for m in unwrapped.modules()), default=0) \
        if attention in (query_chunks.NAME, "sdpa") else 0  # (under Ulysses the chunks stand in for sdpa)
    attention = "sdpa" if chunk else attention  # (sdpa's kernel, a chunk of queries a call)
    facts = SetupFacts(
        distributed_type=accelerator.distributed_type.value,
        engine=ENGINES.get(accelerator.distributed_type.value) or accelerator.distributed_type.value,
        num_processes=accelerator.num_processes,
        process_index=accelerator.process_index,
        device=str(accelerator.device),
        mixed_precision=accelerator.mixed_precision,
        model_class=type(model).__name__,
        fsdp2_modules=sum(isinstance(m, FSDPModule) for m in model.modules()),
        dtensor_params=sum(type(p).__name__ == "DTensor" for p in params),
        params=sum(numel(p) for p in params),
        trainable_params=sum(numel(p) for p in params if p.requires_grad),
        quantized_weights=sum(type(p).__name__ in ("Params4bit", "Int8Params") for p in params),
        trainable_names_all_lora=all("lora_" in n for n, p in model.named_parameters() if p.requires_grad),
        optimizer_class=_optimizer_class(optimizer),
        optimizer_in_backward=hasattr(inner, "optimizers"),
        optimizer_compile_seconds=getattr(inner, "compile_seconds", 0.0),
        gradient_checkpointing=_checkpointing(unwrapped),
        engine_checkpointed_layers=sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules()),
        tiled_mlps=_runs_as(model, tiled_forward),
        lean_norms=_runs_as(model, lean_forward),
        query_chunk=chunk,
        lora_shared_inputs=sum(getattr(m, "cast_input_dtype_enabled", True) is False for m in model.modules()),
        lora_recomputed_dropout=sum(hasattr(m, "input_dropout") for m in model.modules()),
        attention=attention,
        attention_why=getattr(getattr(unwrapped, "memrecipe_attention", None), "why", None),
        bf16_matmuls_in_fp32=cpu_matmul.active(),
        cpu_threads=torch.get_num_threads(),
        allocator_conf=", ".join(f"{k}={os.environ[k]}" for k in ALLOCATOR_CONF if k in os.environ) or None,
        allocator_expandable_segments=_expandable_segments(accelerator.device),
        sequence_parallel=getattr(model, "sequence_parallel_size", 1),
        ulysses_attention=_ulysses(attention),
        context_parallel=Ring(accelerator).size,
    )
    if hasattr(model, "zero_optimization_stage"):  # a DeepSpeedEngine
        _engine_facts(facts, model)
    return facts


def _engine_facts(facts: SetupFacts, engine) -> None:
    """A DeepSpeed engine's ZeRO stage, what it offloads, and its optimizer (around the client's)."""
    offload_param = engine.zero_offload_param()
    facts.zero_stage = engine.zero_optimization_stage()
    facts.zero_offload_optimizer = engine.zero_cpu_offload()
    facts.zero_offload_param = offload_param is not None and \
        str(getattr(offload_param.device, "value", offload_param.device)) == "cpu"
    facts.optimizer_class = type(engine.optimizer).__name__
    facts.client_optimizer_class = type(engine.optimizer.optimizer).__name__ \
        if hasattr(engine.optimizer, "optimizer") else None


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


def _expandable_segments(device) -> bool | None:
    """Whether the CUDA allocator really grows its segments in place (expandable_segments applied): read off its
    segments, each of which says so (torch.cuda.memory_snapshot()'s is_expandable, as torch's own test_cuda reads
    it), not the environment variable. None off CUDA, or before the allocator holds a segment."""
    import torch

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
