"""The planner: model states exact, activations honest, ZeRO-3 as DeepSpeed counts it, the CLI."""

import json
from dataclasses import replace
import weakref
from types import SimpleNamespace

import pytest
import torch

from helpers import loop_model
from memrecipe.planning.architecture import read_config, structure
from memrecipe.errors import RecipeError
from memrecipe.training.loss import fuse_head, lm_loss, token_loss
from memrecipe.planning.registry import EMBEDDED_MODEL

from memrecipe.training.optimizers import make_optimizer
from memrecipe.planning.planner import breakdown, estimate, judge
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology, make_topology
from memrecipe.units import parse_size

CPU1 = Topology(1, cpu=True)
MEDIUM = {"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
          "intermediate_size": 1408, "vocab_size": 32000, "num_hidden_layers": 8, "max_position_embeddings": 512,
          "tie_word_embeddings": False}  # ~55M parameters


TINY_MIXTRAL = {"model_type": "mixtral", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 224,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
                "num_experts_per_tok": 2, "max_position_embeddings": 512, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> folder of a saved random model: the embedded tiny one and a ~55M one."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from memrecipe.training.modeling import embedded_model

    from transformers import AutoConfig

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
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


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
    from memrecipe.planning.planner import activation_bytes, activation_mode

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


def test_known_architectures_count_parameters_exactly():
    from transformers import AutoConfig, AutoModelForCausalLM
    from accelerate import init_empty_weights

    configs = [MEDIUM | {"model_type": "qwen2", "tie_word_embeddings": True},
               MEDIUM | {"model_type": "mistral"}, MEDIUM | {"model_type": "qwen3", "head_dim": 64},
               MEDIUM | {"model_type": "gemma", "head_dim": 64},
               {"model_type": "gpt2", "n_embd": 256, "n_head": 4, "n_layer": 3, "vocab_size": 1000, "n_positions": 128},
               {"model_type": "gpt_neox", "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 3,
                "intermediate_size": 1024, "vocab_size": 1000},
               {"model_type": "phi3", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_hidden_layers": 3, "intermediate_size": 512, "vocab_size": 1000, "pad_token_id": 0}]
    for config in configs:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        model.tie_weights()  # the meta device skips tying; a real model ties its embeddings
        real = sum(p.numel() for p in model.parameters())
        assert structure(config).params == real, config["model_type"]


def test_unknown_architectures_fall_back_to_the_meta_device():
    config = {"model_type": "opt", "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 3,
              "ffn_dim": 1024, "vocab_size": 1000, "word_embed_proj_dim": 256, "max_position_embeddings": 128}
    s = structure(config)
    assert s.layers == 3 and s.params > 3 * 4 * 256 * 256 and "meta device" in s.notes[0]
    with pytest.raises(RecipeError, match="not a causal language model"):
        structure({"model_type": "vit", "hidden_size": 64})


@pytest.mark.parametrize("text, value", [("24GB", 24 * 10**9), ("24 GiB", 24 * 2**30), ("24GiB", 24 * 2**30),
                                         ("1.5TiB", int(1.5 * 2**40)), ("512mib", 512 * 2**20)])
def test_memory_sizes_parse(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["lots", "24", "24 GiBs", "", "-3GB"])
def test_bad_memory_sizes_are_refused(text):
    with pytest.raises(RecipeError, match="not a size"):
        parse_size(text)


def test_plan_recommends_and_finds_micro_batch_and_accumulation(cli, tmp_path):
    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 14336, "vocab_size": 128256, "num_hidden_layers": 32, "tie_word_embeddings": False}))
    done = cli("plan", "--model", str(folder), "--gpu-memory", "24GiB", "--host-memory", "256GiB",
               "max_seq_length=2048", "per_device_train_batch_size=1")
    assert done.returncode == 0, done.stderr
    assert "8.030B parameters" in done.stdout and "LoRA: single-gpu-lora: the fastest" in done.stdout
    assert "adamw-8bit" in done.stdout and "no (-" in done.stdout
    data = json.loads(cli("plan", "--model", str(folder), "--gpu-memory", "80GB", "--num-processes", "8",
                          "--host-memory", "1TiB", "--global-batch", "512", "--json", "max_seq_length=2048").stdout)
    fsdp = next(e for e in data["estimates"] if e["recipe"] == "fsdp")
    micro, acc = (int(x) for x in fsdp["batch"].split(" x "))
    assert micro * acc * 8 == 512 and fsdp["fits"] and fsdp["micro_batch"] == micro and acc > 1
    # the next micro batch that divides the 64 sequences per process does not fit (so the pick is the largest)
    bigger = min(m for m in range(micro + 1, 65) if 64 % m == 0)
    over = estimate(load_recipe("fsdp", [f"per_device_train_batch_size={bigger}", "max_seq_length=2048"]),
                    structure(read_config(str(folder))), Topology(8))
    assert not judge(over, 80 * 10**9, 2**40).fits and over.total > 80 * 10**9
    plot = tmp_path / "plan.png"
    assert cli("plan", "--model", str(folder), "--gpu-memory", "24GiB", "--plot", str(plot)).returncode == 0
    assert plot.stat().st_size > 10_000


@pytest.mark.parametrize("args, words", [
    (["--model", "someone/not-here", "--gpu-memory", "24GiB"], "cannot read config.json"),
    (["--gpu-memory", "lots"], "'lots' is not a size"),
    (["--gpu-memory", "24GiB", "--host-memory", "24"], "'24' is not a size"),
    ([], "no GPU found here: give --gpu-memory"),
    (["--gpu-memory", "1GiB", "per_device_train_batch_size=64"], "nothing fits"),
    (["--gpu-memory", "24GiB", "lora.r=0"], "lora.r must be >= 1"),
    (["--gpu-memory", "24GiB", "--num-processes", "0"], "--num-processes must be >= 1, got 0"),
])
def test_plan_bad_input_is_one_line_exit_2(cli, args, words, tmp_path):
    done = cli("plan", *args)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr.strip().splitlines()[-1] and "Traceback" not in done.stderr


def test_not_a_causal_lm_is_refused(cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 64}))
    done = cli("plan", "--model", str(tmp_path), "--gpu-memory", "24GiB")
    assert done.returncode == 2 and "not a causal language model" in done.stderr


def test_run_refuses_what_will_not_fit_and_names_what_would(cli, tmp_path):
    folder = tmp_path / "llama-70b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
         "intermediate_size": 28672, "vocab_size": 128256, "num_hidden_layers": 80}))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # run checks them before the fit
        (folder / name).write_text((EMBEDDED_MODEL / name).read_text())
    out = tmp_path / "run"
    done = cli("run", "sft", "--recipe", "single-gpu-lora", "--model", str(folder), "--output-dir", str(out))
    assert done.returncode == 2 and "will not fit" in done.stderr and "params" in done.stderr
    assert "--force" in done.stderr and not out.exists()
    assert judge(estimate(load_recipe("single-gpu-lora"), structure(read_config(None)), CPU1), None, 8 * 2**30).fits


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
    from memrecipe.planning.planner import trainable_tensors

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


# --- the lean loss and lean QLoRA: what a Llama-3.1-8B job plans, and the step's measured peak ----

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
            "max_position_embeddings": 131072, "head_dim": 128}
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
        assert plain.logits > 30 * est.logits  # 4.9 GiB of logits, vs one chunk's
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


def test_plan_recommends_the_bf16_full_fine_tune_on_one_gpu(cli, tmp_path):
    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    args = ["plan", "--model", str(folder), "--gpu-memory", "80GB", "--num-processes", "1", "--host-memory", "64GiB",
            "--method", "full", "--json"]
    data = json.loads(cli(*args).stdout)
    assert data["recommendations"]["full"]["recipe"] == "single-gpu-full"
    fits = {e["recipe"]: e["fits"] for e in data["estimates"]}
    assert not fits["adamw-8bit"] and not fits["zero3-offload"]  # 80 GB of GPU; 145 GB of offload in 64 GiB of RAM


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


def test_plan_recommends_within_each_training_method(cli, tmp_path):
    """Full fine-tuning, LoRA and QLoRA are a choice of quality: on 8 x 80 GB an 8B full fine-tune fits
    (fsdp), and it is recommended as such, not traded for LoRA's faster steps."""
    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    args = ["plan", "--model", str(folder), "--gpu-memory", "80GB", "--num-processes", "8", "--host-memory", "1TiB"]
    data = json.loads(cli(*args, "--json").stdout)
    picks = {m: r["recipe"] for m, r in data["recommendations"].items()}
    assert picks == {"full": "fsdp", "lora": "fsdp-lora", "qlora": "fsdp-qlora"}
    assert {e["recipe"]: e["method"] for e in data["estimates"]}["fsdp"] == "full"
    text = cli(*args).stdout
    assert "full fine-tune: fsdp: the fastest recipe that fits" in text and "LoRA: fsdp-lora" in text
    only = cli(*args, "--method", "full", "--json")
    assert json.loads(only.stdout)["recommendations"] == {"full": data["recommendations"]["full"]}


def test_run_suggests_a_recipe_of_the_same_method_first_and_says_when_it_cannot():
    from memrecipe.planning.hardware import Machine
    from memrecipe.launching.checks import check_fits

    gpu = Machine(gpus=1, gpu_memory=16 * 2**30, bf16=True, cores=16, host_memory=64 * 2**30)
    words = ["per_device_train_batch_size=2", "max_seq_length=2048"]
    with pytest.raises(RecipeError) as refused:
        check_fits(load_recipe("single-gpu-lora", words), Topology(1), gpu, words, force=False, shape=structure(LLAMA_8B))
    assert "qlora would fit" in str(refused.value) and "a QLoRA recipe: no LoRA recipe fits" in str(refused.value)
    with pytest.raises(RecipeError) as refused:  # a full fine-tune: the full fine-tune that fits, not LoRA's
        check_fits(load_recipe("adamw-8bit", words), Topology(1), replace(gpu, host_memory=512 * 2**30), words,
                   force=False, shape=structure(LLAMA_8B))
    assert "zero3-offload would fit" in str(refused.value) and "QLoRA" not in str(refused.value)


def test_plan_for_other_machines_gpus_does_not_judge_them_by_this_machines_ram(cli, tmp_path):
    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    args = ["plan", "--model", str(folder), "--gpu-memory", "80GB", "--num-processes", "8"]
    text = cli(*args).stdout
    assert "host RAM not given (--host-memory): HOST is not checked" in text
    data = json.loads(cli(*args, "--json").stdout)
    assert data["host_memory"] is None
    assert {e["recipe"]: e["fits"] for e in data["estimates"]}["zero3-offload"]  # not refused by a laptop's RAM
    given = json.loads(cli(*args, "--host-memory", "64GiB", "--json").stdout)
    assert not {e["recipe"]: e["fits"] for e in given["estimates"]}["zero3-offload"]  # 135 GiB of offload > 64


@pytest.mark.parametrize("content, words", [
    ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100}',
     "lacks intermediate_size"),
    ('{"model_type": "llama",', "is not valid JSON"),
])
def test_a_broken_model_config_is_one_line_in_plan_and_run(cli, tmp_path, content, words):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(content)
    model = str(tmp_path / "model")
    for args in (["plan", "--model", model, "--gpu-memory", "24GiB"],
                 ["run", "sft", "--recipe", "single-gpu-lora", "--model", model, "--output-dir", str(tmp_path / "r")],
                 ["run", "sft", "--recipe", "single-gpu-lora", "--model", model, "--dry-run", "--force",
                  "--output-dir", str(tmp_path / "r")]):
        done = cli(*args)
        assert done.returncode == 2 and "Traceback" not in done.stderr, (args, done.stderr[-500:])
        assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists(), args
    assert words in cli("plan", "--model", model, "--gpu-memory", "24GiB").stderr


# Published configs (the hub's config.json keys the planner reads) and their models' true parameter counts.
PUBLISHED = {
    "Mixtral-8x7B": ({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                      "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
                      "tie_word_embeddings": False}, 46_702_792_704),
    "Qwen2.5-7B": ({"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                    "tie_word_embeddings": False}, 7_615_616_512),
    "Gemma-2-9B": ({"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 3584, "intermediate_size": 14336,
                    "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                    "tie_word_embeddings": True}, 9_241_705_984),
    "Llama-3.1-8B": ({"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                      "tie_word_embeddings": False}, 8_030_261_248),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_are_the_published_models(name):
    config, params = PUBLISHED[name]
    s = structure(config)
    assert s.params == params
    if name == "Mixtral-8x7B":  # ZeRO-3 gathers the largest module whole: one layer's fused experts, 1.41B
        assert s.largest_module == 8 * 3 * 14336 * 4096 and (s.experts, s.top_k) == (8, 2)


SMALL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": None, "bos_token_id": None,
         "eos_token_id": None}


@pytest.mark.parametrize("kind", sorted(__import__("memrecipe.planning.architecture", fromlist=["LLAMA_LIKE"]).LLAMA_LIKE))
def test_families_counted_by_hand_equal_the_modules_transformers_builds(kind):
    """The hand-counted families (no torch in `plan`) against the real modules on the meta device."""
    from transformers import AutoConfig

    from memrecipe.training.meta import structure_from_meta as _from_meta_device

    config = AutoConfig.for_model(kind, **SMALL).to_dict()
    hand, meta = structure(config), _from_meta_device(config)
    assert "meta device" not in " ".join(hand.notes)
    assert (hand.params, hand.largest_module, hand.head_dim) == (meta.params, meta.largest_module, meta.head_dim)


@pytest.mark.parametrize("kind", ["starcoder2", "helium", "cohere", "olmo", "glm", "mixtral", "qwen2_moe"])
def test_other_families_are_read_off_their_real_modules(kind):
    """Families whose hand count was wrong (starcoder2's plain MLP counted as gated, helium's default head_dim
    not applied, cohere's and olmo's norms, glm's fused MLP) or that route tokens to experts: their counts are
    those of the model transformers builds."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(kind, **SMALL)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # as loading does (skipped on the meta device)
    s = structure(config.to_dict())
    assert s.params == sum(p.numel() for p in model.parameters())
    assert s.head_dim == (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    assert (s.experts > 0) == (kind in ("mixtral", "qwen2_moe"))


# mixtures of experts whose first layers are dense (DeepSeek-V3: 3 of 61, GLM-4.5-style, Qwen-MoE's mlp_only_layers)
DENSE_FIRST = {
    "qwen2_moe": {"mlp_only_layers": [0], "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64},
    "deepseek_v3": {"first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16},
}


@pytest.mark.parametrize("kind", DENSE_FIRST)
def test_a_mixture_of_experts_with_dense_first_layers_is_planned_block_by_block(kind):
    """Every block counts, in groups of identical ones: the dense first layer and the routed ones (read as
    blocks[0] x layers, these models were planned without their experts)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(kind, **{**SMALL, "num_hidden_layers": 3}, **DENSE_FIRST[kind])
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    s = structure(config.to_dict())
    assert s.params == sum(p.numel() for p in model.parameters())
    assert [(g.layers, g.experts, g.first) for g in s.groups()] == [(1, 0, 0), (2, 4, 1)]
    assert (s.experts, s.top_k, s.layers) == (4, 2, 3) and "1 of its 3 layers are dense" in s.notes[-1]
    experts = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 3)
    assert sum(g.layers * g.expert_params for g in s.groups()) == experts > 0


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


def test_plan_shows_each_rows_batch_and_what_binds_when_nothing_fits(cli, tmp_path):
    """Each row's micro batch x tokens (recipes differ), a note when a GPU plan uses the recipes' smoke-test sizes,
    the host RAM each recommendation needs, and, when the host RAM is what binds, that and its remedy."""
    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    done = cli("plan", "--model", str(folder), "--gpu-memory", "24GB")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split()[1:4] for line in done.stdout.splitlines() if line.split()[:1] in
            (["single-gpu-full"], ["single-gpu-lora"])}
    assert rows == {"single-gpu-full": ["8", "x", "256"], "single-gpu-lora": ["4", "x", "256"]}
    assert "sized for the CPU smoke test" in done.stdout and "max_seq_length=4096" in done.stdout
    assert "host RAM 119.7 GiB per machine (not checked: give --host-memory)" in done.stdout  # zero2's
    sized = cli("plan", "--model", str(folder), "--gpu-memory", "24GB", "max_seq_length=2048")
    assert "sized for the CPU smoke test" not in sized.stdout
    host = cli("plan", "--model", str(folder), "--gpu-memory", "24GB", "--host-memory", "64GiB", "--method", "full")
    assert host.returncode == 2 and "nothing fits in host RAM: the least is zero2 at 119.7 GiB per machine" in host.stderr
    assert "more host RAM, use more machines" in host.stderr and "per_device_train_batch_size=1" not in host.stderr
