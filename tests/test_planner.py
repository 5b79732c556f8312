"""The planner: model states exact, activations honest, ZeRO-3 and ZeRO-2 as DeepSpeed counts them, the 8B jobs against torchtune's measured peaks."""

import weakref
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from helpers import loop_model
from memrecipe.errors import RecipeError
from memrecipe.planning.architecture import read_config, structure
from memrecipe.planning.planner import breakdown, estimate
from memrecipe.planning.states import base_bytes, trainable_tensors
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology, make_topology
from memrecipe.training.loss import fuse_head, lm_loss, token_loss
from memrecipe.training.optimizers import make_optimizer
from model_configs import DENSE_FIRST, LLAMA_8B, MEDIUM, SMALL, TINY_MIXTRAL

CPU1 = Topology(1, cpu=True)




@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> folder of a saved random model: the embedded tiny one and a ~55M one."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    from memrecipe.training.loading import embedded_model

    folder = tmp_path_factory.mktemp("medium")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**MEDIUM)).save_pretrained(folder)
    mixtral = tmp_path_factory.mktemp("mixtral")
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_MIXTRAL)).save_pretrained(mixtral)
    dense_first = tmp_path_factory.mktemp("qwen2_moe")  # its first layer dense, the next two routed
    AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2_moe", **{**SMALL, "num_hidden_layers": 3, "pad_token_id": 0}, **DENSE_FIRST["qwen2_moe"])).save_pretrained(dense_first)
    return {"tiny": embedded_model(), "medium": str(folder), "mixtral": str(mixtral), "dense-first": str(dense_first),
            "dir": folder.parent}


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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "medium"])
@pytest.mark.parametrize("recipe", ["adamw-8bit", "single-gpu-lora", "adamw-8bit:adamw_torch"])
def test_model_states_equal_the_bytes_held_after_a_real_step(models, name, recipe):
    recipe_name, _, optim = recipe.partition(":")
    r = load_recipe(recipe_name, [f"optim={optim}"] if optim else [])
    model, _ = loop_model(r, models[name], "bf16")
    optimizer = make_optimizer(r, model, SimpleNamespace(device=torch.device("cpu")))
    b = batch(model.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    token_loss(logits, b["labels"]).backward()
    optimizer.step()
    params, grads, state = real_model_state_bytes(model, optimizer)
    est = estimate(r, structure(read_config(models[name])), CPU1)
    assert est.parameters == pytest.approx(params, rel=0.01)
    assert est.gradients == pytest.approx(grads, rel=0.01)
    assert est.optimizer_state == pytest.approx(state, rel=0.01)


def saved_peak(model, b, autocast):
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
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = lm_loss(model, b)
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


ACTIVATION_CASES = [
    ("adamw-8bit", ["gradient_checkpointing=false"]),  # autocast over fp32 weights
    ("single-gpu-lora", ["gradient_checkpointing=false"]),  # LoRA on a bf16 base, dropout 0.05
    ("qlora", ["gradient_checkpointing=false"]),  # NF4 base, fp32 embeddings/norms/head (PEFT's k-bit preparation)
    ("adamw-8bit", ["mixed_precision=no", "gradient_checkpointing=false"]),  # fp32
    ("adamw-8bit", ["attn_implementation=eager", "gradient_checkpointing=false"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "medium"])
@pytest.mark.parametrize("recipe, overrides", ACTIVATION_CASES)
def test_activation_estimate_is_within_10_percent_of_what_autograd_saves(models, name, recipe, overrides):
    """Measured with saved_tensors_hooks: exactly the tensors autograd keeps for backward (the
    profiler's ACTIVATION category also counts short-lived forward temporaries)."""
    measured, est = activation_case(models, name, recipe, overrides)
    assert est["saved_peak"] == pytest.approx(measured, rel=0.1), (est["saved_peak"], measured)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "medium"])
@pytest.mark.parametrize("recipe, overrides", ACTIVATION_CASES[:3])
def test_one_layers_activations_are_within_10_percent(models, name, recipe, overrides):
    """What one more decoder layer adds: the term gradient checkpointing recomputes one layer at a time."""
    one, est = activation_case(models, name, recipe, overrides, layers=1)
    two, _ = activation_case(models, name, recipe, overrides, layers=2)
    assert est["layer"] == pytest.approx(two - one, rel=0.1), (est["layer"], two - one)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "medium"])
@pytest.mark.parametrize("recipe", ["adamw-8bit", "single-gpu-lora", "qlora"])
def test_with_gradient_checkpointing_the_forward_keeps_what_the_planner_says(models, name, recipe):
    """With checkpointing autograd keeps each layer's input (checkpoint's own hooks hold the recompute,
    measured by the test above); the planner's peak adds one recomputed layer to this."""
    measured, est = activation_case(models, name, recipe, ["gradient_checkpointing=true"])
    assert est["forward_saved"] == pytest.approx(measured, rel=0.1), (est["forward_saved"], measured)
    assert est["saved_peak"] >= est["forward_saved"]


@pytest.mark.parametrize("offload", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("nodes, gpus", [(1, 1), (1, 8), (2, 8)])
def test_zero3_model_states_agree_with_deepspeeds_own_estimator(offload, nodes, gpus):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    optimizer_offload, param_offload = offload
    s = structure(read_config(None) | {"num_hidden_layers": 6}) if gpus == 1 else structure(MEDIUM)
    r = load_recipe("zero3-offload", [f"deepspeed.offload_optimizer={'cpu' if optimizer_offload else 'none'}",
                                      f"deepspeed.offload_param={'cpu' if param_offload else 'none'}"])
    topo = make_topology(nodes * gpus, nodes, 0, "10.0.0.1" if nodes > 1 else None, None)
    est = estimate(r, s, topo)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(s.params, s.largest_module, num_gpus_per_node=gpus,
                                                       num_nodes=nodes, cpu_offload=optimizer_offload,
                                                       cpu_offload_params=param_offload, zero_init=True,
                                                       additional_buffer_factor=1.0)
    assert est.model_states == pytest.approx(gpu, rel=1e-6)
    assert est.host_offload == pytest.approx(cpu, rel=1e-6)


def test_sharding_divides_model_states_and_offload_moves_them_to_the_host():
    s = structure(MEDIUM)
    one = estimate(load_recipe("fsdp"), s, Topology(2))
    eight = estimate(load_recipe("fsdp"), s, Topology(8))
    assert eight.optimizer_state == pytest.approx(one.optimizer_state / 4, rel=0.01)
    offload = estimate(load_recipe("fsdp", ["fsdp.offload_params=true"]), s, Topology(8))
    assert offload.optimizer_state == 0 and offload.host_offload > 0
    no_gc = estimate(load_recipe("adamw-8bit", ["gradient_checkpointing=false"]), s, Topology(1))
    gc = estimate(load_recipe("adamw-8bit"), s, Topology(1))
    assert gc.activations < no_gc.activations / 2
    eager = estimate(load_recipe("adamw-8bit", ["attn_implementation=eager", "max_seq_length=2048",
                                                "gradient_checkpointing=false"]), s, Topology(1))
    sdpa = estimate(load_recipe("adamw-8bit", ["max_seq_length=2048", "gradient_checkpointing=false"]), s, Topology(1))
    assert eager.activations > 2 * sdpa.activations  # the s x s scores


@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("gpus", [1, 8])
def test_zero2_model_states_agree_with_deepspeeds_own_estimator(offload, gpus):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    s = structure(MEDIUM)
    r = load_recipe("zero2", [f"deepspeed.offload_optimizer={'cpu' if offload else 'none'}"])
    est = estimate(r, s, Topology(gpus))
    cpu, gpu = estimate_zero2_model_states_mem_needs(s.params, num_gpus_per_node=gpus, num_nodes=1,
                                                     cpu_offload=offload, additional_buffer_factor=1.0)
    assert est.model_states == pytest.approx(gpu, rel=1e-6)
    assert est.host_offload == pytest.approx(cpu, rel=1e-6)


LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}


def test_a_4bit_base_is_half_a_byte_per_layer_weight_and_fsdp_shards_it():
    from memrecipe.planning.states import trainable_tensors

    s = structure(LLAMA_70B)
    trained = sum(t.numel for t in trainable_tensors(load_recipe("qlora"), s))
    layers = s.layers * sum(lin.params for lin in s.linears)
    q = estimate(load_recipe("qlora"), s, Topology(1))
    # NF4 + double-quantized scales ~0.516 bytes/weight; embeddings, head and norms bf16 (the quant storage),
    # or fp32 with PEFT's preparation
    assert q.parameters - 4 * trained == pytest.approx(0.516 * layers + 2 * (s.params - layers), rel=0.005)
    upcast = estimate(load_recipe("qlora", ["quantization.upcast_unquantized=true"]), s, Topology(1))
    assert upcast.parameters - q.parameters == 2 * (s.params - layers)
    two, eight = (estimate(load_recipe("fsdp-qlora", ["fsdp.offload_params=false"]), s, Topology(n)) for n in (2, 8))
    assert eight.parameters < two.parameters / 2
    assert two.gradients == pytest.approx(4 * trained / 2, rel=0.01)  # only the adapters have gradients
    offloaded = estimate(load_recipe("fsdp-qlora"), s, Topology(2))
    assert offloaded.parameters < two.parameters and offloaded.host_offload > 0


@pytest.mark.parametrize("offload", [True, False])
def test_fsdp_qlora_keeps_the_whole_bases_scales_on_every_gpu(offload):
    """FSDP shards or offloads the flat parameters, the packed 4-bit weights; bitsandbytes' quant_state (the absmax
    per 64 weights, its fp32 absmax per 256, the codes) stays whole on each GPU: 1.0 GiB of a 70B's."""
    from memrecipe.planning.states import quant_state_bytes

    s = structure(LLAMA_70B)
    r = load_recipe("fsdp-qlora", [f"fsdp.offload_params={str(offload).lower()}"])
    scales, linear = quant_state_bytes(r, s), s.layers * sum(lin.params for lin in s.linears)
    assert scales == pytest.approx(linear / 64 * (1 + 4 / 256), rel=0.001)
    eight, sixteen = (estimate(r, s, Topology(n)) for n in (8, 16))
    sharded = eight.parameters - sixteen.parameters  # what 8 more GPUs take off each: a sixteenth of the shards
    assert eight.parameters > scales and sixteen.parameters > scales
    if offload:
        # nothing sharded stays on the GPU: fp32 absmax (no double quantization, 4x the scales) adds them whole
        single = load_recipe("fsdp-qlora", ["fsdp.offload_params=true", "quantization.double_quant=false"])
        assert sharded == 0 and estimate(single, s, Topology(8)).parameters - eight.parameters == \
            quant_state_bytes(single, s) - scales > 2 * scales
    else:
        assert sharded == pytest.approx((base_bytes(r, s, 2) - scales + 4 * sum(t.numel for t in
                                         trainable_tensors(r, s))) / 16, rel=0.001)


# --- the lean loss and lean QLoRA: what a Llama-3.1-8B job plans, and the step's measured peak ----

TORCHTUNE_JOB = ["per_device_train_batch_size=2", "max_seq_length=2048", "lora.r=8", "lora.alpha=16"]


@pytest.mark.parametrize("recipe, overrides, offload, without_offload", [
    ("single-gpu-lora", ["lora.target_modules=[q_proj,v_proj]"], 16.2, 17.0),  # torchtune on a 4090: 16.2 GiB
    ("qlora", [], 7.4, 8.0),  # torchtune: 7.4 GiB (LoRA on every linear layer)
])
def test_an_8b_job_plans_no_more_than_torchtune_measures(recipe, overrides, offload, without_offload):
    s = structure(LLAMA_8B)
    for knob, bound in ((True, offload), (False, without_offload)):
        r = load_recipe(recipe, [*TORCHTUNE_JOB, *overrides, f"activation_offload={str(knob).lower()}"])
        est = estimate(r, s, Topology(1))
        assert (est.total - est.overhead) / 2**30 <= bound, (knob, est)
        plain = estimate(load_recipe(recipe, [*TORCHTUNE_JOB, *overrides, "fused_loss=false"]), s, Topology(1))
        assert plain.logits > 6 * est.logits  # 4.9 GiB of logits, vs one 512-token chunk's 0.6
    if recipe == "qlora":  # 16-bit embeddings and head, as the quantized base stores them
        upcast = estimate(load_recipe(recipe, [*TORCHTUNE_JOB, "quantization.upcast_unquantized=true"]), s, Topology(1))
        assert upcast.parameters - est.parameters == 2 * (s.params - s.layers * sum(lin.params for lin in s.linears))


@pytest.mark.parametrize("overrides, bound", [
    ([], 40),  # torchao's 8-bit AdamW (embeddings' state in fp32), the step in backward
    (["optim=apollo_adamw", "optim_args.rank=128"], 24),  # every linear layer, lm_head included, projected
])
def test_an_8b_full_fine_tune_plans_on_one_gpu(overrides, bound):
    """Llama-3.1-8B, 2 x 2048, one GPU, model states on it (today's adamw-8bit: ~80 GiB)."""
    s = structure(LLAMA_8B)
    r = load_recipe("single-gpu-full", ["per_device_train_batch_size=2", "max_seq_length=2048", *overrides])
    est = estimate(r, s, Topology(1))
    assert (est.total - est.overhead) / 2**30 <= bound, breakdown(est)
    assert est.host_total() < 16 * 2**30 and est.host_offload == 0  # nothing parked in host RAM
    assert est.parameters == 2 * s.params and est.gradients == 2 * s.vocab * s.hidden  # bf16; the head's gradient
    ordinary = estimate(replace(r, optimizer_in_backward=False), s, Topology(1))
    assert ordinary.gradients == 2 * s.params  # a model's worth of bf16 gradients without the step in backward
    stock = estimate(load_recipe("adamw-8bit", ["per_device_train_batch_size=2", "max_seq_length=2048"]), s, Topology(1))
    assert stock.total > 75 * 2**30


@pytest.mark.slow
@pytest.mark.parametrize("recipe, overrides", [
    ("single-gpu-lora", []), ("single-gpu-lora", ["fused_loss=false"]),
    ("single-gpu-lora", ["gradient_checkpointing=false"]),
    ("single-gpu-lora", ["gradient_checkpointing=false", "fused_loss=false"]),
])
def test_the_steps_peak_is_what_the_planner_calls_working_memory(models, recipe, overrides):
    """A whole forward and backward, every allocation recorded by the profiler: with checkpointing the
    loss and a layer's recompute peak at different moments (the larger counts); without it, together.
    LoRA, so that the gradients (the adapters') are small beside what is measured. (A full fine-tune's
    gradients peak at the end of backward, not with the loss: the planner's sum is conservative there.)"""
    import gc

    from memrecipe.training.measure import allocation_peak

    B, S = 2, 256
    r = load_recipe(recipe, [*overrides, f"per_device_train_batch_size={B}", f"max_seq_length={S}"])
    model, _ = loop_model(r, models["medium"], "bf16")
    if r.fused_loss:
        fuse_head(model)
    model.train()  # checkpointing and dropout act in training mode only
    ids = torch.randint(0, MEDIUM["vocab_size"], (B, S), generator=torch.Generator().manual_seed(0))
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    gc.collect()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, b)
        loss.backward()
    est = estimate(r, structure(read_config(models["medium"])), CPU1)
    assert est.working + est.gradients == pytest.approx(allocation_peak(profile), rel=0.1)
    assert est.working < est.activations + est.logits or not r.gradient_checkpointing


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [[], ["gradient_checkpointing=false"]])
def test_a_dpo_steps_peak_is_what_the_planner_plans_for_its_rows(models, overrides):
    """A preference micro batch as recipes/dpo.py runs it (the reference pass with the adapters off, under no_grad,
    then the policy's sequence log-probs, the loss, backward) over 2 packed rows of the embedded pairs, every
    allocation profiled: the reference's forward is over before the policy's starts, so the step holds what an
    SFT step over the same rows holds, and the planner plans it so. (Chunks of 64 target tokens: the pairs' targets
    are their completions, fewer than the plan's every-token-a-target, and the chunk is then the same size.)"""
    import gc
    import json
    import sys

    from datasets import Dataset

    from helpers import REPO

    from memrecipe.planning.registry import EMBEDDED_PREFERENCES
    from memrecipe.training.measure import allocation_peak
    from memrecipe.training.loading import embedded_model
    from memrecipe.training.tokenizer import load_tokenizer
    from memrecipe.training.preference import (PairCollator, pack_pairs, preference_sums, sequence_logps,
                                               tokenize_pair, window_loss)

    sys.path.insert(0, str(REPO / "recipes"))
    from dpo import Preference  # the loop's own reference pass

    B, S = 2, 256
    r = load_recipe("single-gpu-lora", [*overrides, f"per_device_train_batch_size={B}", f"max_seq_length={S}",
                                        "loss_chunk_tokens=64", "lora.dropout=0"], script="dpo")
    model, _ = loop_model(r, models["medium"], "bf16")  # the loop's setup: its head fused, in chunks of 64 targets
    model.train()
    tokenizer = load_tokenizer(embedded_model())
    pairs = [tokenize_pair(json.loads(line), tokenizer, S // 2) for line in open(EMBEDDED_PREFERENCES)][:40]
    rows = list(pack_pairs(Dataset.from_list(pairs), S))[:B]
    batch = PairCollator(tokenizer.pad_token_id, multiple=S)(rows)  # rows of S tokens, as the planner plans them
    assert batch["input_ids"].shape == (B, S) and batch["attention_mask"].float().mean() > 0.8
    assert (batch["labels"][:, 1:] != -100).sum() > 64
    dpo = r.dpo
    gc.collect()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reference = Preference(r).reference(model, batch, SimpleNamespace(unwrap_model=lambda m: m))
            sums = preference_sums(sequence_logps(model, batch), reference, batch, dpo)
            loss = window_loss(sums, sums["pairs"], 0)
        loss.backward()
    est = estimate(r, structure(read_config(models["medium"])), CPU1)
    assert est.working + est.gradients == pytest.approx(allocation_peak(profile), rel=0.1)








MOE_LORA = ["lora.dropout=0.0"]  # peft's LoRA on fused experts (ParamWrapper) takes no dropout


@pytest.mark.parametrize("moe", ["mixtral", "dense-first"])
@pytest.mark.parametrize("recipe", ["single-gpu-lora", "single-gpu-lora:q_proj,v_proj", "adamw-8bit", "adamw-8bit:adamw_torch"])
def test_a_mixture_of_experts_holds_what_the_planner_says(models, recipe, moe):
    """A tiny Mixtral, and a Qwen-MoE whose first layer is dense, loaded as each recipe loads it, after a real step:
    LoRA all-linear adapts its fused experts and router too (peft reads them off the modules), a full fine-tune
    trains the 3-D expert tensors."""
    name, _, extra = recipe.partition(":")
    overrides = MOE_LORA if name == "single-gpu-lora" else []
    if extra:
        overrides = [*overrides, f"lora.target_modules=[{extra}]" if "proj" in extra else f"optim={extra}"]
    r = load_recipe(name, overrides)
    model, _ = loop_model(r, models[moe], "bf16")
    optimizer = make_optimizer(r, model, SimpleNamespace(device=torch.device("cpu")))
    ids = batch(512)["input_ids"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    params, grads, state = real_model_state_bytes(model, optimizer)
    est = estimate(r, structure(read_config(models[moe])), CPU1)
    assert (est.parameters, est.gradients, est.optimizer_state) == pytest.approx((params, grads, state), rel=0.01)


@pytest.mark.parametrize("recipe, overrides", [("adamw-8bit", ["gradient_checkpointing=false"]),
                                               ("single-gpu-lora", ["gradient_checkpointing=false", *MOE_LORA])])
def test_a_mixture_of_experts_layers_activations_count_top_k_routing(models, recipe, overrides):
    """Each token is routed to top_k experts: what one more Mixtral layer saves for backward, measured."""
    one, est = activation_case(models, "mixtral", recipe, overrides, layers=1)
    two, _ = activation_case(models, "mixtral", recipe, overrides, layers=2)
    assert est["layer"] == pytest.approx(two - one, rel=0.1), (est["layer"], two - one)


def test_qlora_and_dropout_on_fused_experts_are_refused_with_the_reason(models, cli):
    s = structure(read_config(models["mixtral"]))
    with pytest.raises(RecipeError, match=r"QLoRA saves little on mixtral, whose experts \(75% of its parameters\)"):
        estimate(load_recipe("qlora", MOE_LORA), s, CPU1)
    with pytest.raises(RecipeError, match="lora.dropout must be 0 for this model"):
        estimate(load_recipe("single-gpu-lora"), s, CPU1)
    done = cli("plan", "--model", models["mixtral"], "--gpu-memory", "24GiB", "--recipe", "qlora")
    assert done.returncode == 2 and "QLoRA saves little" in done.stderr and "Traceback" not in done.stderr

