"""The refusal rules: a recipe dict -> a validated Recipe (`make_recipe`), refusing technique combinations that fail
or silently do the wrong thing, each group of rules a function; and the recipe as a loop script reads it
(`for_script`: its objective's section, what run dpo does not run)."""

from __future__ import annotations

from ..errors import RecipeError
from .optimizers import OPTIMIZERS
from .recipe import DPO_LEARNING_RATE, PREFERENCE_LOSSES, Dpo, Recipe, losses_reading, losses_with
from .rungs import checks
from .schema import build


def make_recipe(data: dict) -> Recipe:
    """Validate a recipe dict (its base chain and overrides merged: registry.load_recipe) into a Recipe,
    refusing bad keys and bad combinations."""
    recipe = build(Recipe, data)
    check_combinations(recipe)
    return recipe


def check_combinations(r: Recipe) -> None:
    """Refuse technique combinations that fail, or silently do the wrong thing (each group of rules, in turn)."""
    for check in (check_preference, check_sections, check_quantization, check_parallelism, check_fsdp,
                  check_optimizer, check_lora, check_data, check_deepspeed):
        check(r)
    checks(r)  # the activation ladder's: each rung's own, in its entry of rungs.py


def check_preference(r: Recipe) -> None:
    """The dpo: section's keys, and a pair's row within what the plan counts."""
    if r.dpo is None:
        return
    check_dpo(r.dpo)
    if r.dpo.max_length is not None and 2 * r.dpo.max_length > r.max_seq_length:
        raise RecipeError(f"dpo.max_length={r.dpo.max_length} lets a pair's two sequences fill {2 * r.dpo.max_length} "
                          f"tokens of one row, above max_seq_length={r.max_seq_length} (what the memory plan "
                          f"counts): set dpo.max_length <= {r.max_seq_length // 2}, or max_seq_length >= "
                          f"{2 * r.dpo.max_length}")


def check_sections(r: Recipe) -> None:
    """distributed_type and the engine sections it reads; supports; the warmup."""
    if r.distributed_type == "fsdp" and r.fsdp is None:
        raise RecipeError("distributed_type fsdp needs an fsdp: section (e.g. fsdp: {version: 2})")
    if r.distributed_type == "deepspeed" and r.deepspeed is None:
        raise RecipeError("distributed_type deepspeed needs a deepspeed: section (e.g. deepspeed: {zero_stage: 3})")
    if r.fsdp is not None and r.distributed_type != "fsdp":
        raise RecipeError(f"the fsdp: section is only read with distributed_type fsdp, not {r.distributed_type}")
    if r.deepspeed is not None and r.distributed_type != "deepspeed":
        raise RecipeError(f"the deepspeed: section is only read with distributed_type deepspeed, not {r.distributed_type}")
    if r.distributed_type == "no" and r.supports.max_processes != 1:
        raise RecipeError("distributed_type no runs one process: set supports.max_processes to 1 (or use ddp)")
    s = r.supports
    if s.max_processes is not None and s.max_processes < s.min_processes:
        raise RecipeError(f"supports.max_processes ({s.max_processes}) is below supports.min_processes ({s.min_processes})")
    if r.warmup_steps and r.warmup_ratio:
        raise RecipeError("set warmup_steps or warmup_ratio, not both")


def check_quantization(r: Recipe) -> None:
    q = r.quantization
    if q is None:
        return
    if r.lora is None:
        raise RecipeError("quantization freezes the base in 4/8 bits, which cannot be trained: add a lora: "
                          "section (QLoRA), or set quantization=null")
    if r.deepspeed is not None:
        raise RecipeError("quantization is not supported with DeepSpeed in memrecipe: use the fsdp-qlora recipe "
                          "(FSDP1 + QLoRA) for several GPUs")
    if r.fsdp is not None and q.upcast_unquantized:
        raise RecipeError("quantization.upcast_unquantized would mix fp32 and 16-bit weights in one FSDP unit "
                          "(FSDP shards one dtype): set quantization.upcast_unquantized=false")
    if r.fsdp is not None and (q.bits != 4 or q.quant_storage == "uint8" or r.fsdp.version != 1):
        raise RecipeError("FSDP shards quantized weights only as 4-bit with a float quant_storage under FSDP1: "
                          "set quantization.bits=4, quantization.quant_storage=bf16, fsdp.version=1")


def check_parallelism(r: Recipe) -> None:
    """Tensor parallelism (FSDP2), Ulysses sequence parallelism (DeepSpeed) or ring attention (FSDP2), each through
    accelerate's ParallelismConfig, one at a time, and what each cannot run with."""
    tp, sp, cp = r.tensor_parallel, r.sequence_parallel, r.context_parallel
    asked = [f"parallelism.{key}={value}" for key, value, on in (("tp_size", tp, tp > 1), ("sp_size", sp, sp != 1),
                                                                 ("cp_size", cp, cp > 1)) if on]
    if len(asked) > 1:
        raise RecipeError(f"{' and '.join(asked)}: one way of splitting at a time (tensor parallelism and ring "
                          "attention run on FSDP2, Ulysses on DeepSpeed): set the others to 1")
    if tp > 1:
        check_tensor_parallel(r)
    if sp != 1:
        check_sequence_parallel(r)
    if cp > 1:
        check_context_parallel(r)


def check_tensor_parallel(r: Recipe) -> None:
    if r.fsdp is None or r.fsdp.version != 2:
        raise RecipeError("parallelism.tp_size composes with FSDP2 only (accelerate's ParallelismConfig): set "
                          "distributed_type fsdp and fsdp.version=2")
    if r.fused_loss:
        raise RecipeError("fused_loss needs the whole vocabulary on every process, and tensor parallelism splits "
                          "lm_head's output over tp_size processes: set fused_loss=false")
    if r.lora is not None or r.quantization is not None:
        raise RecipeError("the tp recipe trains the full model: LoRA and quantization under tensor parallelism "
                          "are not supported (set lora=null, quantization=null)")


def check_sequence_parallel(r: Recipe) -> None:
    """Ulysses (DeepSpeed's UlyssesSPAttentionHF, which accelerate registers in prepare): the attention runs on whole
    sequences for 1/sp of the heads, with no attention mask (it drops it) and causal by position."""
    if r.deepspeed is None:
        raise RecipeError("parallelism.sp_size is Ulysses sequence parallelism, which accelerate runs on DeepSpeed "
                          "only (sp_backend deepspeed): use the zero3-ulysses recipe, or set parallelism.sp_size=1")
    if r.deepspeed.zero_stage != 3:
        # ZeRO-3's reduce-scatter averages a gradient over all the processes (stage3.py, __avg_scatter_grads), what the
        # loop's scale assumes; stage 1 and 2 divide by processes / sp_size (stage_1_and_2.py): not checked here
        raise RecipeError(f"parallelism.sp_size runs on ZeRO-3 in memrecipe (stage {r.deepspeed.zero_stage} averages "
                          "gradients over another group, not checked here): set deepspeed.zero_stage=3")
    if r.attn_implementation in ("eager", "flex_attention"):
        raise RecipeError(f"attn_implementation={r.attn_implementation} cannot run under sequence parallelism "
                          "(accelerate refuses eager and flex_attention there): set attn_implementation=sdpa, or "
                          "flash_attention_2 on CUDA")
    if r.packing and r.attn_implementation != "flash_attention_2":
        raise RecipeError("packing under sequence parallelism needs attn_implementation=flash_attention_2: Ulysses "
                          "drops the attention mask, so under sdpa a packed row's documents would attend to each "
                          "other: set packing=false (one example per row), or attn_implementation=flash_attention_2 "
                          "on CUDA")
    if r.torch_compile:
        raise RecipeError("torch_compile under sequence parallelism is not checked in memrecipe: set "
                          "torch_compile=false")


def check_context_parallel(r: Recipe) -> None:
    """Ring attention: torch's context_parallel, which accelerate prepares on FSDP2 (Accelerator._prepare_cp) with
    hooks that drop each attention's mask and make it causal (big_modeling._attach_context_parallel_hooks); torch
    replaces SDPA's CUDA kernels with ring ones (_context_parallel/_attention.py) and no other kernel."""
    if r.fsdp is None or r.fsdp.version != 2:
        raise RecipeError("parallelism.cp_size is ring attention, which accelerate runs on FSDP2 only: use fsdp or "
                          "fsdp-lora (fsdp.version=2), or zero3-ulysses for sequence parallelism on DeepSpeed")
    if r.attn_implementation not in ("auto", "sdpa"):
        raise RecipeError(f"attn_implementation={r.attn_implementation} cannot run under ring attention (torch "
                          "replaces SDPA's kernels only): set attn_implementation=sdpa")
    if r.packing:
        raise RecipeError("packing under ring attention: accelerate drops the attention mask and runs each row "
                          "causal, so a packed row's documents would attend to each other: set packing=false (one "
                          "example per row)")
    if r.torch_compile:
        raise RecipeError("torch_compile under ring attention is not checked in memrecipe: set torch_compile=false")


def check_fsdp(r: Recipe) -> None:
    if not r.fsdp:
        return
    if r.fsdp.version == 2 and not r.fsdp.use_orig_params:
        raise RecipeError("fsdp.use_orig_params=false is FSDP1's flat parameters: FSDP2 always keeps the "
                          "original ones (set fsdp.version=1, or drop the key)")
    if r.fsdp.version == 1 and r.lora and r.fsdp.use_orig_params:
        raise RecipeError("fsdp.version=1 with LoRA needs fsdp.use_orig_params=false: FSDP1 flattens a unit's "
                          "parameters into one tensor of one dtype (torch's FlatParamHandle), and a decoder layer holds "
                          "the 16-bit base beside LoRA's fp32 adapters; with flat parameters PEFT's wrap policy gives "
                          "each adapter a unit of its own (or keep fsdp.version=2)")
    if r.fsdp.version == 1 and r.lora and r.lora.bias != "none":
        raise RecipeError(f"lora.bias={r.lora.bias} under fsdp.version=1: a trained bias would sit in its frozen "
                          "layer's flat parameter, which holds one dtype and trains or not as a whole (torch's "
                          "FlatParamHandle): set lora.bias=none, or fsdp.version=2")
    if r.uses_bnb and r.fsdp.version == 2:
        raise RecipeError(f"optim {r.optim} cannot run under FSDP2: bitsandbytes cannot update DTensor state "
                          "(use optim=adamw_torch, or fsdp.version=1, or distributed_type ddp)")
    if r.lora and r.fsdp.activation_checkpointing:
        raise RecipeError("LoRA with fsdp.activation_checkpointing saves an EMPTY adapter (the checkpoint wrapper "
                          "renames modules): set fsdp.activation_checkpointing=false and gradient_checkpointing=true")
    if r.gradient_checkpointing and r.fsdp.activation_checkpointing:
        raise RecipeError("gradient_checkpointing and fsdp.activation_checkpointing both checkpoint the same layers: "
                          "keep one")


def check_deepspeed(r: Recipe) -> None:
    """torch_compile under the sharding engines; DeepSpeed's offload and stages."""
    if r.torch_compile and (r.fsdp or r.deepspeed):
        raise RecipeError(f"torch_compile is not supported under {'FSDP' if r.fsdp else 'DeepSpeed'} in memrecipe (their "
                          "hooks gather each layer's weights around its forward): use it with distributed_type no or ddp")
    ds = r.deepspeed
    if ds is None:
        return
    if r.uses_bnb and ds.offload_optimizer != "none":
        raise RecipeError(f"optim {r.optim} cannot run with deepspeed.offload_optimizer={ds.offload_optimizer}: "
                          "DeepSpeed's offload runs its own CPU Adam and would drop the 8-bit optimizer (use "
                          "optim=adamw_torch)")
    if ds.offload_param != "none" and ds.zero_stage != 3:
        raise RecipeError(f"deepspeed.offload_param needs zero_stage 3, got zero_stage {ds.zero_stage}")
    if ds.offload_optimizer != "none" and ds.zero_stage == 0:
        raise RecipeError("deepspeed.offload_optimizer needs zero_stage 1, 2 or 3, got 0")


def check_dpo(d: Dpo) -> None:
    losses = d.losses
    if not losses:
        raise RecipeError(f"dpo.loss_type is an empty list: name at least one ({', '.join(PREFERENCE_LOSSES)})")
    if d.loss_weights is not None and len(d.loss_weights) != len(losses):
        raise RecipeError(f"dpo.loss_weights has {len(d.loss_weights)} weight(s) for {len(losses)} loss_type(s) "
                          f"({', '.join(losses)}): give one per loss")
    for key, unset in (("label_smoothing", 0.0), ("simpo_gamma", None)):
        value = getattr(d, key)
        if value != unset and not d.reads(key):
            readers, off = losses_reading(key), "null" if unset is None else f"{unset:g}"
            raise RecipeError(f"dpo.{key}={value:g} is read by loss_type {' and '.join(readers)} only, not by "
                              f"{', '.join(losses)}: use {'one of them' if len(readers) > 1 else 'loss_type ' + readers[0]}"
                              f", or {key} {off}")
    free = [loss for loss in losses if PREFERENCE_LOSSES[loss].reference is False]
    if free and not d.reference_free:
        raise RecipeError(f"dpo.loss_type {', '.join(free)} uses no reference model and the others "
                          f"({', '.join(x for x in losses if PREFERENCE_LOSSES[x].reference)}) do: combine {free[0]} "
                          f"with {' or '.join(losses_with(None))} only")
    if free and d.precompute_ref_log_probs:
        raise RecipeError(f"dpo.precompute_ref_log_probs: loss_type {free[0]} uses no reference model, so there is "
                          "nothing to precompute: leave it null")
    if all(PREFERENCE_LOSSES[loss].reference is None for loss in losses):
        raise RecipeError(f"dpo.loss_type {', '.join(losses)} alone is supervised fine-tuning on the chosen "
                          "completions: add a preference loss (e.g. [sigmoid, sft]), or use memrecipe run sft")


def for_script(r: Recipe, script: str) -> Recipe:
    """The recipe as a loop script reads it: its objective's section is its own (`run sft` refuses a `dpo:` section,
    which it would leave unread; `run dpo` gives a recipe without one TRL's defaults, and trains at
    dpo.learning_rate, a preference-tuning rate), and what the preference loop does not run yet is refused, saying so."""
    from dataclasses import replace

    if script == "sft" and r.dpo is not None:
        raise RecipeError("run sft does not read the dpo: section (preference tuning's keys): remove it (dpo=null)")
    if script != "dpo":
        return r
    dpo = r.dpo or Dpo()
    rate = dpo.learning_rate or (DPO_LEARNING_RATE["lora"] if r.lora else DPO_LEARNING_RATE["full"])
    r = replace(r, learning_rate=rate, dpo=replace(dpo, learning_rate=rate))  # the rate the loop reads, said once
    if r.tensor_parallel > 1:
        raise RecipeError("run dpo does not run tensor parallelism in this release: use fsdp-lora or fsdp for a model "
                          "that one GPU cannot hold")
    if r.sequence_parallel != 1:
        raise RecipeError("run dpo does not run sequence parallelism in this release (a pair's log-probs would be "
                          "split over the group's processes): set parallelism.sp_size=1, or use zero3-offload")
    if r.context_parallel > 1:
        raise RecipeError("run dpo does not run ring attention in this release (a pair's log-probs would be split "
                          "over the ring's processes): set parallelism.cp_size=1")
    if r.dpo.reference_free:  # no reference model, so nothing below applies
        return r
    if r.lora is not None and r.lora.init_lora_weights in ("pissa", "olora"):
        raise RecipeError(f"lora.init_lora_weights {r.lora.init_lora_weights} rewrites the base, so the adapters off "
                          "are not the reference model: use init_lora_weights true under run dpo (or a "
                          f"reference-free loss_type: {', '.join(losses_with(False))})")
    return r


def check_optimizer(r: Recipe) -> None:
    """The optimizer's own keys: what each needs, and which engines leave it room."""
    engine = "FSDP" if r.fsdp else "DeepSpeed" if r.deepspeed else None
    optimizer = OPTIMIZERS[r.optim]
    if r.distributed_type not in optimizer.engines:
        raise RecipeError(f"optim {r.optim} {optimizer.why_not}: use it with distributed_type "
                          f"{' or '.join(optimizer.engines)} (or optim=adamw_torch)")
    if r.low_rank and r.lora is not None:
        raise RecipeError(f"optim {r.optim} keeps low-rank state for full fine-tuning; LoRA's adapters are low-rank "
                          "already: set lora=null, or optim=adamw_torch")
    if r.weight_dtype == "bf16":
        if r.lora is not None:
            raise RecipeError("weight_dtype is for full fine-tuning: LoRA keeps its frozen base in the compute dtype "
                              "and its adapters in fp32 (set weight_dtype=fp32)")
        if engine:
            raise RecipeError(f"weight_dtype bf16 is for one process or DDP: {engine} keeps its own weight copies "
                              "(set weight_dtype=fp32)")
    if r.mixed_precision == "fp16" and r.fp16_blocker:
        raise RecipeError(f"{r.fp16_blocker}: set mixed_precision=bf16 (or auto on a GPU with bf16)")
    if r.optimizer_in_backward:
        if r.distributed_type != "no":
            raise RecipeError("optimizer_in_backward runs on one process: under ddp, fsdp or deepspeed gradients are "
                              "reduced across processes after the hook would have used them (set distributed_type no)")
        if r.gradient_accumulation_steps > 1:
            raise RecipeError("optimizer_in_backward updates each parameter as soon as its gradient is complete, so "
                              "gradients cannot add up over micro batches: set gradient_accumulation_steps=1 (and "
                              "raise per_device_train_batch_size instead)")
        if r.max_grad_norm is not None:
            raise RecipeError("optimizer_in_backward cannot clip: the norm of all gradients is known only after the "
                              "whole backward, when each parameter is already updated (as in torchtune): set "
                              "max_grad_norm=null")


def template_fields(template: str) -> list[str]:
    """The column names a `{column}` template refers to (a template that is not one: RecipeError)."""
    import string

    try:
        return [name for _, name, _, _ in string.Formatter().parse(template) if name]
    except ValueError as e:  # an unclosed or single brace
        raise RecipeError(f"the template {template!r} is not a {{column}} template ({e}; a literal brace is "
                          "written {{ or }})") from None


def check_data(r: Recipe) -> None:
    """The data keys that can be judged without reading the data: a list of sources is not empty, and each
    column template parses."""
    for key in ("dataset", "eval_dataset"):
        spec = getattr(r, key)
        if spec == ():
            raise RecipeError(f"{key} is an empty list: give a path (null: the embedded dataset) or one or more "
                              "{path: ...} entries")
        for i, source in enumerate(spec if isinstance(spec, tuple) else ()):
            for field_name, template in vars(source.columns).items():
                if template and "{" in template:  # (data.py's rule: a spec with a brace is a template)
                    try:
                        template_fields(template)
                    except RecipeError as e:
                        raise RecipeError(f"{key}[{i}].columns.{field_name}: {e}") from None


def check_lora(r: Recipe) -> None:
    """LoRA options that an engine or the base cannot carry."""
    lora = r.lora
    if lora is None:
        return
    rewrites = lora.init_lora_weights in ("pissa", "olora")
    if rewrites and (r.fsdp or r.deepspeed):
        raise RecipeError(f"lora.init_lora_weights {lora.init_lora_weights} rewrites the base as it loads, which "
                          "memrecipe supports on one process or DDP: use distributed_type no or ddp (or "
                          "init_lora_weights=true)")
    if rewrites and r.quantization:
        raise RecipeError(f"lora.init_lora_weights {lora.init_lora_weights} on a quantized base re-quantizes the "
                          "rewritten weights, so the saved adapter cannot be converted back exactly: use it without "
                          "quantization (or init_lora_weights=true)")
    if rewrites and lora.use_dora:
        raise RecipeError(f"lora.use_dora cannot be converted back from init_lora_weights {lora.init_lora_weights} "
                          "(the magnitude is learned on the rewritten base): use one of them")
    if lora.use_dora and r.deepspeed and r.deepspeed.zero_stage == 3:
        raise RecipeError("lora.use_dora reads each base weight whole inside the adapter, where ZeRO-3 keeps it "
                          "partitioned: use fsdp-lora or one process (or use_dora=false)")
