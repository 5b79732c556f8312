"""planning/states.py: the model states per engine (parameters, gradients, optimizer state; sharded, partitioned,
offloaded, quantized) equal the bytes a model holds after a real step and DeepSpeed's own estimators."""

from types import SimpleNamespace

import pytest
import torch

from helpers import loop_model
from measuring import batch, real_model_state_bytes
from memrecipe.planning.architecture import read_config, structure
from memrecipe.planning.planner import estimate
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.states import base_bytes, trainable_tensors
from memrecipe.planning.topology import Topology, make_topology
from memrecipe.training.loss import token_loss
from memrecipe.training.optimizers import make_optimizer
from model_configs import MEDIUM, MOE_LORA

CPU1 = Topology(1, cpu=True)


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


def r_words(offload):
    optimizer_offload, param_offload = offload
    return [f"deepspeed.offload_optimizer={'cpu' if optimizer_offload else 'none'}",
            f"deepspeed.offload_param={'cpu' if param_offload else 'none'}"]


@pytest.mark.parametrize("offload", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("nodes, gpus", [(1, 1), (1, 8), (2, 8)])
def test_zero3_model_states_agree_with_deepspeeds_own_estimator(offload, nodes, gpus):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    optimizer_offload, param_offload = offload
    s = structure(read_config(None) | {"num_hidden_layers": 6}) if gpus == 1 else structure(MEDIUM)
    r = load_recipe("zero3-offload", r_words(offload))
    topo = make_topology(nodes * gpus, nodes, 0, "10.0.0.1" if nodes > 1 else None, None)
    est = estimate(r, s, topo)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(s.params, s.largest_module, num_gpus_per_node=gpus,
                                                       num_nodes=nodes, cpu_offload=optimizer_offload,
                                                       cpu_offload_params=param_offload, zero_init=True,
                                                       additional_buffer_factor=1.0)
    # beside them the reduce bucket its estimator leaves out: stage3.py allocates reduce_bucket_size elements of the
    # communication dtype (bf16 here) on the device when contiguous_gradients is on
    assert r.deepspeed.contiguous_gradients and r.deepspeed.reduce_bucket_size == 500_000_000
    assert est.model_states == pytest.approx(gpu + 2 * 500_000_000, rel=1e-6)
    # and on the host, unpinned, the flat 16-bit gradients of the offloaded optimizer (stage3.py
    # grad_partitions_flat_buffer, on the optimizer's device); pinned, each tensor its power-of-two block, and with
    # the parameters offloaded their first partitions too, freed into torch's cache (planning.states)
    unpinned = estimate(load_recipe("zero3-offload", [*r_words(offload), "deepspeed.pin_memory=false"]), s, topo)
    assert unpinned.host_offload == pytest.approx(cpu + (2 * s.params // nodes if optimizer_offload else 0), rel=1e-6)
    freed = 2 * s.params // nodes if param_offload else 0
    if optimizer_offload or param_offload:
        assert unpinned.host_offload < est.host_offload < 2 * (unpinned.host_offload + freed)
    else:  # nothing offloaded, nothing pinned
        assert unpinned.host_offload == est.host_offload


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
    if not offload:
        assert est.host_offload == pytest.approx(cpu, rel=1e-6)
        return
    # on the host, unpinned, beside its estimator's what it leaves out (planning.states.zero2_host_tensors, recorded
    # in test_pinned.py): a 16-bit buffer of each partition, the largest parameter's 16-bit buffer per process, and
    # under gradient accumulation (2, as shipped) a 16-bit accumulator of each parameter; or loading's fp32 copies
    unpinned = estimate(load_recipe("zero2", ["deepspeed.pin_memory=false"]), s, Topology(gpus))
    largest, loading, states = max(t.numel for t in s.tensors()), 4 * s.params * gpus, 16 * s.params
    assert cpu == pytest.approx(max(loading, states), rel=1e-6)  # (the estimator's: fp32 master, gradient, moments)
    assert unpinned.host_offload == pytest.approx(max(loading, states + 4 * s.params + 2 * largest * gpus), rel=1e-6)
    assert unpinned.host_pinned == 0 and est.host_pinned > 0


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


def test_dpos_frozen_copy_under_fsdp_is_planned_loading_whole_on_every_rank():
    """Under FSDP2 rank 0 alone loads the policy (cpu_ram_efficient_loading); DPO's frozen copy is then loaded whole
    by every process before it is sharded (reference.frozen_copy: own_weights): 8 fp32 copies of an 8B on the host."""
    from model_configs import LLAMA_8B

    s = structure(LLAMA_8B)
    copy = load_recipe("fsdp", ["dpo.precompute_ref_log_probs=false"], script="dpo")
    store = load_recipe("fsdp", ["dpo.precompute_ref_log_probs=true"], script="dpo")
    eight = Topology(8)
    assert estimate(store, s, eight).host_load == 4 * s.params  # rank 0's fp32 load alone
    assert estimate(copy, s, eight).host_load == 8 * 4 * s.params
