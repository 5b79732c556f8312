"""planning/activations.py: the bytes a micro batch saves for backward, held to what autograd really saves
(saved_tensors_hooks) on the embedded model and a ~55M one, per layer, with checkpointing, and under top-k routing."""

import pytest
import torch

from measuring import activation_case
from memrecipe.planning.activations import dropout_bytes, layer_activation_bytes
from memrecipe.planning.architecture import read_config, structure
from memrecipe.planning.registry import load_recipe
from model_configs import LLAMA_8B, MOE_LORA

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


@pytest.mark.parametrize("recipe, overrides", [("adamw-8bit", ["gradient_checkpointing=false"]),
                                               ("single-gpu-lora", ["gradient_checkpointing=false", *MOE_LORA])])
def test_a_mixture_of_experts_layers_activations_count_top_k_routing(models, recipe, overrides):
    """Each token is routed to top_k experts: what one more Mixtral layer saves for backward, measured."""
    one, est = activation_case(models, "mixtral", recipe, overrides, layers=1)
    two, _ = activation_case(models, "mixtral", recipe, overrides, layers=2)
    assert est["layer"] == pytest.approx(two - one, rel=0.1), (est["layer"], two - one)


def saved_bytes(fn, x) -> int:
    """Bytes of the tensors autograd keeps for backward from fn(x), the input itself left out."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(x)
    return sum(t.untyped_storage().nbytes() for t in saved if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr())


def test_dropout_keeps_fp32_noise_on_cpu_and_a_bool_mask_on_the_fused_kernel_gpus_run():
    """What LoRA's dropout costs per element, by device: on CPU F.dropout multiplies by a noise tensor of the input's
    dtype; on CUDA it runs native_dropout (ATen's fused kernel), whose backward reads a bool mask. The fused op runs
    on CPU too when called directly: its bytes are measured here, not assumed."""
    x = torch.randn(64, 256, requires_grad=True)  # fp32, as peft casts an adapter's input
    assert saved_bytes(lambda t: torch.nn.functional.dropout(t, 0.05, training=True), x) == 4 * x.numel()
    assert saved_bytes(lambda t: torch.native_dropout(t, 0.05, True)[0], x) == 1 * x.numel()
    assert dropout_bytes(cuda=False) == 4 and dropout_bytes(cuda=True) == 1


@pytest.mark.parametrize("recipe", ["single-gpu-lora", "qlora"])
def test_a_redrawn_dropout_is_not_kept_on_either_device(recipe):
    """Llama-3.1-8B, LoRA and QLoRA on every linear layer: adapters redraw their dropout in backward
    (training.adapters.recompute_dropout), so a layer keeps the same with dropout as without, on a GPU as on CPU;
    what differs by device is the mask made again in the down adapter's recompute (dropout_bytes). Compiled layers
    keep peft's dropout: a GPU keeps 3 bytes less per adapter input element than the CPU (~117 KB a token)."""
    s = structure(LLAMA_8B)
    kept = {(dropout, cuda): layer_activation_bytes(load_recipe(recipe, [f"lora.dropout={dropout}",
                                                                         "lora.target_modules=all-linear"]),
                                                    s, "lora", 1, 1024, "flash_attention_2", cuda)
            for dropout in (0.0, 0.05) for cuda in (False, True)}
    assert len(set(kept.values())) == 1, kept
    compiled = load_recipe(recipe, ["lora.dropout=0.05", "lora.target_modules=all-linear", "torch_compile=true"])
    cpu, gpu = (layer_activation_bytes(compiled, s, "lora", 1, 1024, "flash_attention_2", cuda) for cuda in (False, True))
    inputs = sum(lin.in_features for lin in s.lora_linears(compiled.lora.target_modules))
    assert cpu - gpu == 3 * 1024 * inputs and 116_000 < (cpu - gpu) / 1024 < 118_000  # peft's masks, by device


@pytest.mark.parametrize("recipe, overrides, precision", [
    ("single-gpu-lora", [], "bf16"),  # LoRA on a bf16 base, dropout 0.05: its A and B matmuls kept too
    ("single-gpu-lora", ["tiled_mlp=2"], "bf16"),  # none of a tiled MLP's (its backward recomputes them anyway)
    ("adamw-8bit", ["gradient_checkpointing=true"], "bf16"),  # autocast over fp32 weights
    ("adamw-8bit", ["gradient_checkpointing=true", "mixed_precision=no"], "no"),  # fp32
])
def test_selective_checkpointing_keeps_what_the_plan_says_and_trains_as_full_checkpointing(recipe, overrides,
                                                                                           precision):
    """Beside each layer's input, selective checkpointing keeps every matmul's and attention's output: the bytes the
    forward leaves held (the CPU profiler) exceed full checkpointing's by the planner's count, and the loss and
    gradients are full checkpointing's."""
    from helpers import loop_model
    from measuring import batch, held_after_forward
    from memrecipe.planning.activations import activation_bytes, activation_mode
    from memrecipe.training.loading import embedded_model

    measured, planned = {}, {}
    for mode in ("true", "selective"):
        r = load_recipe(recipe, [*overrides, f"gradient_checkpointing={mode}", "max_seq_length=48"])
        torch.manual_seed(0)
        model, _ = loop_model(r, embedded_model(), precision)
        model.train()
        torch.manual_seed(1)  # the same dropout draws
        measured[mode] = held_after_forward(model, batch(model.config.vocab_size), autocast=precision == "bf16")
        s = structure(read_config(None))
        planned[mode] = activation_bytes(r, s, activation_mode(r, 2 if precision == "bf16" else 4), 2, 48)
    kept = measured["selective"][1] - measured["true"][1]
    assert kept == pytest.approx(planned["selective"]["forward_saved"] - planned["true"]["forward_saved"], rel=0.02)
    assert kept > 2 * planned["true"]["forward_saved"]  # (not a rounding error: several times what full keeps)
    assert measured["selective"][0] == measured["true"][0]
    for name, grad in measured["true"][2].items():
        torch.testing.assert_close(measured["selective"][2][name], grad, rtol=0, atol=1e-5, msg=name)


def test_selective_checkpointing_is_planned_for_dense_models_only():
    from memrecipe.errors import RecipeError
    from memrecipe.planning.planner import estimate
    from memrecipe.planning.topology import Topology
    from model_configs import TINY_MIXTRAL

    with pytest.raises(RecipeError, match="selective is planned for dense models; mixtral routes tokens to experts"):
        estimate(load_recipe("adamw-8bit", ["gradient_checkpointing=selective"]), structure(TINY_MIXTRAL), Topology(1))


@pytest.mark.parametrize("recipe, overrides, precision", [
    ("single-gpu-lora", [], "bf16"),  # LoRA on a bf16 base, dropout 0.05 (its fp32 noise on CPU)
    ("single-gpu-lora", ["lora.dropout=0"], "bf16"),
    ("adamw-8bit", [], "bf16"),  # autocast over fp32 weights
    ("adamw-8bit", ["mixed_precision=no"], "no"),  # fp32
    ("adamw-8bit", ["weight_dtype=bf16"], "bf16"),  # 16-bit weights
])
def test_a_tiled_mlp_frees_what_the_plan_says(recipe, overrides, precision):
    """Without checkpointing every layer's tensors are held when the forward ends: with the MLP in 4 tiles they fall
    by the planner's mlp_bytes per token and layer, within 10% and never planned to fall further than they do."""
    from helpers import loop_model
    from measuring import batch, saved_at_forward_end
    from memrecipe.planning.activations import activation_mode, mlp_bytes
    from memrecipe.training.loading import embedded_model

    held = {}
    for tiles in ("false", "4"):
        r = load_recipe(recipe, [*overrides, "gradient_checkpointing=false", f"tiled_mlp={tiles}", "max_seq_length=48"])
        torch.manual_seed(0)
        model, _ = loop_model(r, embedded_model(), precision)
        model.train()
        held[tiles] = saved_at_forward_end(model, batch(model.config.vocab_size), autocast=precision == "bf16")
    s = structure(read_config(None))
    freed = held["false"] - held["4"]
    planned = 2 * 48 * s.layers * mlp_bytes(r, s, activation_mode(r, 2 if precision == "bf16" else 4), cuda=False)
    assert 0.9 * freed <= planned <= freed, (planned, freed)


WIDE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64}  # the embedded Llama widened: per-token costs dominate
LADDER = {"none": ["gradient_checkpointing=false"], "selective": ["gradient_checkpointing=selective"],
          "full": ["gradient_checkpointing=true"], "offload": ["gradient_checkpointing=true", "activation_offload=true"],
          "tiled": ["gradient_checkpointing=true", "tiled_mlp=true"],
          "lean": ["gradient_checkpointing=true", "tiled_mlp=true", "lean_norms=true"],
          "lean, none": ["gradient_checkpointing=false", "lean_norms=true"]}


def widened(tmp_path_factory, **config_overrides) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    from memrecipe.training.loading import embedded_model

    config = AutoConfig.from_pretrained(embedded_model())
    config.update(WIDE | config_overrides)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("wide")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return widened(tmp_path_factory)


@pytest.mark.parametrize("recipe, rung, overrides", [
    *[("single-gpu-lora", rung, []) for rung in LADDER],  # LoRA on every linear, dropout 0.05 (peft's fp32 casts)
    ("single-gpu-lora", "full", ["lora.dropout=0"]), ("single-gpu-lora", "tiled", ["lora.dropout=0"]),  # shared
    ("single-gpu-lora", "lean", ["lora.dropout=0"]),
    ("qlora", "full", []), ("qlora", "lean", []),  # adapters over 4-bit linears (bitsandbytes' CPU kernels)
    *[("single-gpu-full", rung, []) for rung in ("none", "full", "tiled", "lean", "lean, none")],
    ("adamw-8bit", "full", [])])  # autocast over fp32 weights
def test_the_plans_working_peak_is_a_steps_allocation_peak_at_every_length(wide, recipe, rung, overrides):
    """Long sequences, each rung of the ladder, LoRA, QLoRA and a full fine-tune: from 256 to 1024 tokens the
    bytes the forward leaves for backward grow at the plan's per-token slope, and at both lengths the most a whole
    step holds at once beside the weights and their gradients (backward's own gradient buffers included: the CPU
    profiler's memory timeline) is the plan's working activations, each within 10%. (Two lengths fix a line: the
    plan is linear in tokens under every kernel these recipes run on CPU, and a missing or extra per-token term
    shows in the level at 1024 or in the slope.)"""
    from helpers import loop_model
    from measuring import held_after_forward, step_peak
    from memrecipe.planning.activations import activation_bytes, activation_mode

    s = structure(read_config(wide))
    held, planned = {}, {}
    for length in (256, 1024):
        r = load_recipe(recipe, [*LADDER[rung], *overrides, f"max_seq_length={length}", "per_device_train_batch_size=1",
                                 "packing=false", "optimizer_in_backward=false"])
        model, _ = loop_model(r, wide, "bf16")
        model.train()
        ids = torch.randint(0, s.vocab, (1, length), generator=torch.Generator().manual_seed(0))
        b = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(length)[None]}
        held[length] = held_after_forward(model, b, autocast=True)[1]
        model.zero_grad(set_to_none=True)
        plan = activation_bytes(r, s, activation_mode(r, 2), 1, length)
        # on CPU the host is the device: the offloaded inputs stay where they are, held as without the offload
        kept = plan if rung != "offload" else activation_bytes(load_recipe(recipe, [
            *overrides, "gradient_checkpointing=true", f"max_seq_length={length}", "per_device_train_batch_size=1",
            "packing=false"]), s, activation_mode(r, 2), 1, length)
        planned[length] = kept["forward_saved"]
        peak = step_peak(model, b, autocast=True)
        assert plan["working"] == pytest.approx(peak, rel=0.1), (length, plan["working"], peak)
    slope = (held[1024] - held[256]) / 768
    assert (planned[1024] - planned[256]) / 768 == pytest.approx(slope, rel=0.1), (planned, held)


@pytest.mark.parametrize("recipe, words, low, high", [
    ("single-gpu-lora", ["gradient_checkpointing=selective", "lora.dropout=0"], 0.98, 1.02),  # was 0.92x
    ("single-gpu-lora", ["gradient_checkpointing=selective", "tiled_mlp=true", "lora.dropout=0"], 0.98, 1.02),  # 0.90x
    ("single-gpu-full", ["gradient_checkpointing=selective"], 0.99, 1.01),  # was 0.977x: the uncached output
    # no checkpointing: the final norm's place binds too (was 0.983x), and layer 0's input norm keeps nothing over
    # the frozen embedding's output (1.038x planned as every layer's)
    ("single-gpu-lora", ["gradient_checkpointing=false", "lora.dropout=0"], 0.98, 1.02)])
def test_selective_checkpointing_and_the_final_norms_backward_are_planned(wide, recipe, words, low, high):
    """Selective checkpointing keeps every layer's matmul outputs to the end of backward, so the binding place can
    be the final norm's backward (its fp32 copy and five fp32 buffers beside every layer's outputs), not a layer's;
    and in a layer's backward the output of its last matmul stays cached: the recompute stops at the layer's last
    saved tensor, an input of that matmul, packed before it runs. LoRA without dropout on every linear, and a full
    fine-tune: the plan within 2% of the step's peak at 1,024 tokens (1% for the full fine-tune)."""
    from helpers import loop_model
    from measuring import step_peak
    from memrecipe.planning.activations import activation_bytes, activation_mode

    s, length = structure(read_config(wide)), 1024
    r = load_recipe(recipe, [*words, "activation_offload=false", f"max_seq_length={length}",
                             "per_device_train_batch_size=1", "packing=false", "optimizer_in_backward=false",
                             "attn_implementation=sdpa"])
    model, _ = loop_model(r, wide, "bf16")
    model.train()
    ids = torch.randint(0, s.vocab, (1, length), generator=torch.Generator().manual_seed(0))
    b = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(length)[None]}
    peak, plan = step_peak(model, b, autocast=True), activation_bytes(r, s, activation_mode(r, 2), 1, length)["working"]
    assert low <= plan / peak <= high, (plan / peak, plan, peak)


@pytest.mark.parametrize("rung", ["none", "full"])
def test_peft_dropout_kept_by_each_adapter_is_planned_as_measured(wide, rung):
    """lora.redraw_dropout=false: peft's own dropout, each adapter keeping its mask and its 16-bit dropped input
    (Recipe.keeps_dropout), where the redraw keeps only the input its siblings share. The plan is the step's
    peak within 10% either way, and what peft's dropout adds to it (every layer's adapters without checkpointing, a
    recomputed layer's with it) is the plan's difference within 15% without checkpointing. Under full checkpointing
    the plan's difference is 0.79x the measured one (8.4 of 10.7 MB at 1,024 tokens; the plan 6.5% under the peak):
    a term of the recomputed layer's backward not found yet, held here within 25% so that it cannot grow unseen."""
    from helpers import loop_model
    from measuring import step_peak
    from memrecipe.planning.activations import activation_bytes, activation_mode
    from memrecipe.training.adapters import dropped_forward

    s, length, peaks, plans = structure(read_config(wide)), 1024, {}, {}
    for redraw in ("true", "false"):
        r = load_recipe("single-gpu-lora", [*LADDER[rung], f"lora.redraw_dropout={redraw}", f"max_seq_length={length}",
                                            "per_device_train_batch_size=1", "packing=false",
                                            "optimizer_in_backward=false"])
        model, _ = loop_model(r, wide, "bf16")
        model.train()
        redraws = sum(getattr(m.forward, "func", None) is dropped_forward for m in model.modules())
        assert redraws == (7 * s.layers if redraw == "true" else 0), redraws
        ids = torch.randint(0, s.vocab, (1, length), generator=torch.Generator().manual_seed(0))
        b = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids),
             "position_ids": torch.arange(length)[None]}
        peaks[redraw], plans[redraw] = step_peak(model, b, autocast=True), activation_bytes(
            r, s, activation_mode(r, 2), 1, length)["working"]
        assert plans[redraw] == pytest.approx(peaks[redraw], rel=0.1), (redraw, plans[redraw], peaks[redraw])
    kept = peaks["false"] - peaks["true"]
    assert kept > 0.05 * peaks["true"], peaks
    assert plans["false"] - plans["true"] == pytest.approx(kept, rel=0.15 if rung == "none" else 0.25), (plans, peaks)


@pytest.mark.parametrize("rung", ["none", "full"])
def test_lora_under_deepspeeds_bf16_engine_keeps_what_the_plan_says(wide, rung):
    """DeepSpeed's bf16 engine computes without autocast, and ZeRO-3 built partitioned (zero.Init) leaves peft's fp32
    adapters uncast (engine.py, _cast_module_mixed_precision): each adapter cast its input to fp32 and kept that copy,
    a layer's saved bytes 1.6x the plan's (2.3x with dropout) where the 8-GPU long-context rows are planned. The
    adapters now hold the engine's bf16 (training.adapters.add_lora), read their input as it comes and redraw their
    dropout in backward, in bf16: the step's peak is the plan's within 5% (0.99-1.02x), with and without dropout.
    Under full checkpointing with dropout the peak is the down projection's redraw (its bf16 mask and dropped product
    beside the product's gradient: mlp_places; the plan 8% under the peak without it; peft's dropout kept plans
    1.3x it)."""
    from helpers import loop_model
    from measuring import step_peak
    from memrecipe.planning.activations import activation_bytes, activation_mode
    from memrecipe.training.adapters import dropped_forward

    s, length = structure(read_config(wide)), 1024
    for dropout in (0, 0.05):
        r = load_recipe("zero3-ulysses", [*LADDER[rung], "activation_offload=false", "lora.r=16", f"lora.dropout={dropout}",
                                          "lora.target_modules=all-linear", f"max_seq_length={length}", "tiled_mlp=false",
                                          "lean_norms=false"])
        model, _ = loop_model(r, wide, "bf16", engine="DEEPSPEED")
        model.train()
        assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.bfloat16}
        redraws = sum(getattr(m.forward, "func", None) is dropped_forward for m in model.modules())
        assert redraws == (7 * s.layers if dropout else 0), redraws
        ids = torch.randint(0, s.vocab, (1, length), generator=torch.Generator().manual_seed(0))
        b = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids),
             "position_ids": torch.arange(length)[None]}
        peak, plan = step_peak(model, b, autocast=False), activation_bytes(r, s, activation_mode(r, 2), 1, length)["working"]
        assert plan == pytest.approx(peak, rel=0.05), (dropout, plan, peak)


@pytest.mark.parametrize("rung, rel", [("none", 0.07), ("full", 0.07), ("lean", 0.07), ("selective", 0.03)])
@pytest.mark.parametrize("dropout", [0.05, 0])
def test_lora_in_fp32_is_planned_as_frozen_layers_with_peft_dropout(wide, rung, rel, dropout):
    """LoRA with `mixed_precision: no` (no autocast: peft's forward as it is) was planned as a full fine-tune in
    fp32: 0.72x a step's peak with the recipes' dropout of 0.05 (each adapter's fp32 dropped copy of its input and the
    CPU's dropout noise beside it), 1.17x without (frozen norms and linears keep less). Planned now as frozen layers
    with their adapters (activations.frozen_fp32_bytes): the plan is the step's peak within 7% (0.97-1.06x, all
    linears adapted or q and v only), without and with full checkpointing and with the tiled MLP and lean norms.
    Under selective checkpointing within 3% (1.00-1.03x): it read 0.95x with every linear adapted, the last layer's
    forward binding (peft's scaled adapter output and its sum beside the activation, every cache made:
    activations.selective_forward_bytes), and 0.97x with dropout, the down projection's adapter in the recompute
    (mlp_places: selective checkpointing replays the layer too). The tiled MLP alone reads 1.03-1.10x: not held."""
    from helpers import loop_model
    from measuring import step_peak
    from memrecipe.planning.activations import activation_bytes

    s, length = structure(read_config(wide)), 1024
    for targets in ("all-linear", "[q_proj,v_proj]"):
        r = load_recipe("single-gpu-lora", [*LADDER[rung], f"max_seq_length={length}", "packing=false",
                                            "attn_implementation=sdpa", "per_device_train_batch_size=1",
                                            "optimizer_in_backward=false", f"lora.dropout={dropout}",
                                            f"lora.target_modules={targets}", "mixed_precision=no"])
        model, _ = loop_model(r, wide, "no")
        model.train()
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        ids = torch.randint(0, s.vocab, (1, length), generator=torch.Generator().manual_seed(0))
        b = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids),
             "position_ids": torch.arange(length)[None]}
        plan = activation_bytes(r, s, "fp32", 1, length)["working"]
        assert plan == pytest.approx(step_peak(model, b, autocast=False), rel=rel), targets


@pytest.fixture(scope="module")
def normed(tmp_path_factory):
    """Qwen3, OLMo 2 and Gemma 3 at the widened Llama's widths: their attention norms its query and key (per head;
    over the projection; per head), OLMo 2 norms the MLP's output before the residual add, Gemma 3 both before and
    after attention and the MLP."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, Olmo2Config, Qwen3Config

    made = {}
    for kind, config in (("qwen3", Qwen3Config), ("olmo2", Olmo2Config), ("gemma3", Gemma3TextConfig)):
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(kind)
        AutoModelForCausalLM.from_config(config(**WIDE, vocab_size=512, max_position_embeddings=4096,
                                                eos_token_id=None, pad_token_id=None, bos_token_id=None)).save_pretrained(folder)
        made[kind] = str(folder)
    return made


@pytest.mark.parametrize("kind, rung, low, high, packed", [
    ("qwen3", "none", 0.95, 1.05, False), ("qwen3", "full", 0.95, 1.05, False), ("qwen3", "tiled", 0.95, 1.05, False),
    ("olmo2", "none", 0.95, 1.05, False), ("olmo2", "full", 0.95, 1.05, False),
    ("olmo2", "tiled", 0.95, 1.05, False), ("gemma3", "full", 0.95, 1.05, False), ("gemma3", "tiled", 0.95, 1.05, False),
    ("olmo2", "none", 0.95, 1.05, True), ("gemma3", "full", 0.95, 1.05, True)])  # two documents a row: sdpa's mask
def test_query_and_key_norms_and_a_norm_after_the_mlp_are_planned(normed, kind, rung, low, high, packed):
    """Qwen3's, Gemma 3's and OLMo 2's attention norm the query and key before RoPE: their RMSNorm keeps an fp32 copy
    of each projection's output, which Llama's layers keep nothing of (architecture.Structure.qk_norms); the plan
    was 0.88x / 0.85x the step's peak without it (Qwen3 / OLMo 2, no checkpointing). OLMo 2 (and Gemma 2 and 3) norm
    the MLP's output: that norm's backward runs first in the layer's, the MLP's tensors still held (0.91x under full
    checkpointing without that place); under the tiled MLP no tile's tensors are live there yet (1.08-1.14x with
    them counted). Gemma 2's and 3's two more hidden-wide norms keep an fp32 copy each (0.91x without). LoRA on
    every linear, 1,024 tokens: the plan within 5% of the peak. Packed, two documents a row, with sdpa's mask beside
    them."""
    from helpers import loop_model
    from measuring import step_peak
    from memrecipe.planning.activations import activation_bytes, activation_mode

    s, length = structure(read_config(normed[kind])), 1024
    r = load_recipe("single-gpu-lora", [*LADDER[rung], "activation_offload=false", f"max_seq_length={length}",
                                        "lora.dropout=0", "attn_implementation=sdpa", f"packing={str(packed).lower()}"])
    model, _ = loop_model(r, normed[kind], "bf16")
    model.train()
    ids = torch.randint(0, s.vocab, (1, length), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(length) % (length // 2 if packed else length)
    b = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids), "position_ids": positions[None]}
    peak, plan = step_peak(model, b, autocast=True), activation_bytes(r, s, activation_mode(r, 2), 1, length)["working"]
    assert low <= plan / peak <= high, (plan, peak)


def test_a_packed_row_under_sdpa_is_planned_with_its_boolean_mask(wide):
    """Rows packed with four documents under sdpa: transformers builds a 1-byte [S x S] mask once a forward, which
    each layer's checkpoint keeps for its recompute to the end of backward (attention.kept_mask_bytes; without
    checkpointing it is gone by the loss). The plan is the step's peak within 2% at 1,024 and 2,048 tokens (3.7% and
    6.7% low without the mask)."""
    from helpers import loop_model
    from measuring import step_peak
    from memrecipe.planning.activations import activation_bytes, activation_mode

    s = structure(read_config(wide))
    for length in (1024, 2048):
        r = load_recipe("single-gpu-lora", ["gradient_checkpointing=true", f"max_seq_length={length}",
                                            "packing=true", "attn_implementation=sdpa", "per_device_train_batch_size=1",
                                            "optimizer_in_backward=false"])
        model, _ = loop_model(r, wide, "bf16")
        model.train()
        ids = torch.randint(0, s.vocab, (1, length), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(length // 4).repeat(4)[None]  # four documents, positions restarting at 0
        b = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids), "position_ids": positions}
        plan = activation_bytes(r, s, activation_mode(r, 2), 1, length)["working"]
        assert plan == pytest.approx(step_peak(model, b, autocast=True), rel=0.02), length


def test_the_loops_autocast_frees_each_16_bit_weight_copy_after_its_matmul(tmp_path_factory):
    """A checkpointed full fine-tune over fp32 weights: torch's autocast caches each weight's bf16 copy until the
    forward and the loss are done, so at the loss every layer's copy would be held beside the activations (the
    first GPU run's adamw-8bit row measured the 1B's 1.7 GiB of them: docs/gpu.md). The loop's autocast
    (make_accelerator's) has no cache: on 8 layers at 256 tokens, where the copies are half the step's peak, the peak
    is the plan's working bytes within 10%, and torch's default autocast holds the layers' copies on top."""
    from accelerate.state import AcceleratorState

    from helpers import loop_model
    from measuring import profiled_peak
    from memrecipe.planning.activations import activation_bytes, activation_mode
    from memrecipe.training.accelerator import make_accelerator
    from memrecipe.training.loss import lm_loss

    deep = widened(tmp_path_factory, num_hidden_layers=8)
    s, length = structure(read_config(deep)), 256
    r = load_recipe("adamw-8bit", [f"max_seq_length={length}", "per_device_train_batch_size=1", "packing=false"])
    assert r.gradient_checkpointing and activation_mode(r, 2) == "mixed"
    model, _ = loop_model(r, deep, "bf16")
    model.train()
    ids = torch.randint(0, s.vocab, (1, length), generator=torch.Generator().manual_seed(0))
    b = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(length)[None]}

    def step(autocast):
        with autocast:
            loss = lm_loss(model, b)
        loss.backward()
        model.zero_grad(set_to_none=True)

    AcceleratorState._reset_state(True)
    try:
        loops = profiled_peak(lambda: step(make_accelerator(r, mixed_precision="bf16").autocast()))
    finally:
        AcceleratorState._reset_state(True)
    cached = profiled_peak(lambda: step(torch.autocast("cpu", dtype=torch.bfloat16)))
    planned = activation_bytes(r, s, "mixed", 1, length)["working"]
    copies = 2 * s.layers * sum(lin.params for lin in s.linears)
    assert loops == pytest.approx(planned, rel=0.1), (loops, planned)
    # the cache's peak is at the loss (the activations and every copy), the loop's in a layer's backward
    assert cached - loops > copies / 2, (cached, loops, copies)


@pytest.mark.parametrize("tied", [True, False])
def test_a_later_micro_batch_holds_the_embeddings_gradient_as_the_plan_says(tmp_path_factory, tied):
    """A full fine-tune's micro batches after the first add into the .grad the first left: autograd writes each
    gradient out first. A head tied to the embedding (Llama-3.2-1B's) has its gradient from the loss's backward held
    until the embedding's arrives, beside every layer's backward (the second GPU lease's adamw-8bit row measured
    its allocator peak 0.95 GiB above the plan that left this out; the term is 0.98 GiB). At a width where that
    gradient is a third of the step's peak, a second micro batch's peak is the plan's within 10%, tied or not."""
    from helpers import loop_model
    from measuring import profiled_peak
    from memrecipe.planning.activations import activation_bytes
    from memrecipe.training.loss import lm_loss

    folder = widened(tmp_path_factory, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                     num_key_value_heads=4, vocab_size=16384, tie_word_embeddings=tied)
    s, length = structure(read_config(folder)), 512
    r = load_recipe("adamw-8bit", [f"max_seq_length={length}", "per_device_train_batch_size=1", "packing=false",
                                   "gradient_accumulation_steps=2"])
    model, _ = loop_model(r, folder, "bf16")
    model.train()
    assert (model.get_input_embeddings().weight is model.get_output_embeddings().weight) == tied
    ids = torch.randint(0, s.vocab, (1, length), generator=torch.Generator().manual_seed(0))
    b = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(length)[None]}

    def micro_batch():
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):  # the loop's (no weight cache)
            loss = lm_loss(model, b)
        loss.backward()

    micro_batch()  # the first: its gradients become the .grad
    later = profiled_peak(micro_batch)
    assert later == pytest.approx(activation_bytes(r, s, "mixed", 1, length)["working"], rel=0.1)


def test_ring_attention_plans_each_process_a_slice_and_the_rings_buffers_in_backward():
    """parallelism.cp_size: a process of a ring of 8 holds at 8 x L tokens what one process holds at L, but in a
    layer's backward, where the gathered keys and values and the gradients' fp32 accumulators come beside it (read
    off torch's source: no ring kernel runs on CPU). The 8B's MLP backward outweighs them; a narrow MLP does not."""
    from memrecipe.planning.activations import activation_bytes, ring_bytes

    length, plain, split = 32768, load_recipe("fsdp-lora", ["packing=false"]), load_recipe(
        "fsdp-lora", ["packing=false", "parallelism.cp_size=8"])
    for model, beside in ((LLAMA_8B, False), (LLAMA_8B | {"intermediate_size": 1024}, True)):
        s = structure(model)
        one = activation_bytes(plain, s, "lora", 1, length, "sdpa", cuda=True)
        ring = activation_bytes(split, s, "lora", 1, 8 * length, "sdpa", cuda=True)
        assert (ring["activations"], ring["saved_peak"]) == (one["activations"], one["saved_peak"])
        if beside:  # the ring's place is backward's largest
            assert one["working"] < ring["working"] <= one["working"] + ring_bytes(s, "lora", length, 8)
        else:
            assert ring["working"] == one["working"]


@pytest.mark.parametrize("kernel, overrides", [
    ("flash_attention_2", ["lora.dropout=0", "tiled_mlp=true"]),  # the kernel's backward binds
    ("flex_attention", ["lora.dropout=0", "tiled_mlp=true"]),  # ... flex's own buffers, o_proj reading its output
    ("flex_attention", ["tiled_mlp=16"]),  # LoRA's dropout redrawn over the whole sequence in o_proj's backward
    ("sdpa", ["lora.dropout=0", "tiled_mlp=true", "attn_implementation=sdpa", "query_chunks=256"])])  # sdpa's CUDA kernel in query chunks
def test_on_a_gpu_the_plan_is_a_steps_peak_with_stand_ins_for_the_cuda_kernels(wide, monkeypatch, kernel, overrides):
    """The CUDA kernels, stood in for on CPU by what they allocate (tests/standins.py, from their sources): flash-attn
    2's, compiled flex_attention's and the fused dropout's. On the top rung the plan for a GPU (cuda=True) is the
    step's allocation peak within 3% and its per-token slope within 2%. Without the attention output's gradient (dout:
    the term the third lease's H200 found missing) flash's slope is 7% low; with flash's buffers flex's plan is 21%
    high. The tiled rows hold the MLP input's whole gradient (the profiler's GRADIENT left out for the parameters
    only: measuring.only_parameters_gradients; a plan without that gradient is 8% under flex's peak) and the tiled
    MLP's random states as CUDA's (standins.CudaRandomState). LoRA as shipped (dropout 0.05) with 16 MLP tiles: the
    adapters outside the MLP redraw their dropout in tiles too (tiling.tile_redraws; the plan 3.7% under the peak
    without them). sdpa's kernel in query chunks of 256 (training.query_chunks through standins.TorchFlash): the
    plan's blocks of queries and keys, where sdpa's whole backward would bind."""
    import standins
    from helpers import loop_model
    from measuring import step_peak
    from memrecipe.planning.activations import activation_bytes, activation_mode

    monkeypatch.setattr(torch.nn.functional, "dropout", standins.cuda_dropout)
    standins.use_cuda_random_states(monkeypatch)
    s = structure(read_config(wide))
    peaks, plans = {}, {}
    for length in (1024, 2048):
        r = load_recipe("single-gpu-lora", ["gradient_checkpointing=true", "lean_norms=true", *overrides,
                                            f"max_seq_length={length}", "packing=false",
                                            "per_device_train_batch_size=1", "optimizer_in_backward=false"])
        model, _ = loop_model(r, wide, "bf16")
        if kernel == "sdpa":
            standins.use_torch_flash(monkeypatch)
        else:
            standins.use(model, f"standin_{kernel}")
        model.train()
        ids = torch.randint(0, s.vocab, (1, length), generator=torch.Generator().manual_seed(0))
        b = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(length)[None]}
        peaks[length] = step_peak(model, b, autocast=True)
        plans[length] = activation_bytes(r, s, activation_mode(r, 2), 1, length, attention=kernel, cuda=True)["working"]
        assert plans[length] == pytest.approx(peaks[length], rel=0.03), (length, plans[length], peaks[length])
    assert (plans[2048] - plans[1024]) / 1024 == pytest.approx((peaks[2048] - peaks[1024]) / 1024, rel=0.02)


@pytest.mark.parametrize("recipe, engine", [("single-gpu-lora", "NO"), ("zero3-ulysses", "DEEPSPEED")])
def test_a_layers_recompute_leaves_out_the_tiled_mlp_and_the_peak_is_the_plans(wide, monkeypatch, recipe, engine):
    """The fourth lease's flex_attention rows peaked 1.06-1.08x over the plan at the end of a layer's recompute: the
    tiled MLP ran again there and its tiles' outputs and their concatenation (two [tokens x hidden]) sat beside
    everything the layer saved (snapshot_peak.txt: tiling.py's forward). The recompute now leaves the MLP out
    (tiling.TiledMLP's idle_in_recompute: backward recomputes each tile anyway, and nothing after a Llama layer's MLP
    saves its output). At 8K tokens (32 tiles; the place binds once the sequence is long beside a tile) the step's
    peak is the plan's within 1.5% (0.997x) with the flex_attention stand-in; computing the MLP in the recompute puts
    it over (1.03x). Under DeepSpeed's engine too (its bf16 without autocast; its recompute stops early at the MLP's
    save, which comes after the MLP ran): 1.001x, 1.04x with the MLP."""
    import standins
    from helpers import loop_model
    from measuring import step_peak
    from memrecipe.planning.activations import activation_bytes, activation_mode
    from memrecipe.training import tiling

    monkeypatch.setattr(torch.nn.functional, "dropout", standins.cuda_dropout)
    standins.use_cuda_random_states(monkeypatch)
    s, length = structure(read_config(wide)), 8192
    r = load_recipe(recipe, ["gradient_checkpointing=true", "lean_norms=true", "tiled_mlp=true", "activation_offload=false",
                             "lora.r=16", "lora.target_modules=all-linear", "lora.dropout=0", f"max_seq_length={length}",
                             "packing=false", "per_device_train_batch_size=1", "optimizer_in_backward=false"])
    plan = activation_bytes(r, s, activation_mode(r, 2), 1, length, attention="flex_attention", cuda=True)["working"]
    ids = torch.randint(0, s.vocab, (1, length), generator=torch.Generator().manual_seed(0))
    b = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids),
         "position_ids": torch.arange(length)[None]}
    peaks = []
    for idle in (True, False):
        monkeypatch.setattr(tiling, "mlp_output_unsaved", lambda layer, idle=idle: idle)
        model, _ = loop_model(r, wide, "bf16", engine=engine)
        standins.use(model, "standin_flex_attention")
        model.train()
        peaks.append(step_peak(model, b, autocast=engine == "NO"))
    assert peaks[0] == pytest.approx(plan, rel=0.015), (peaks[0], plan)
    assert peaks[1] > 1.02 * plan, (peaks[1], plan)  # the recompute's MLP: over the plan


def test_the_fused_dropout_stand_in_allocates_what_cudas_kernel_does():
    """CUDA's native_dropout: the output and a bool mask, 5 bytes an fp32 element at its peak (CPU's makes an fp32
    noise on the way: 9); its backward one gradient."""
    import standins
    from measuring import allocation_peak_of

    x = torch.randn(1024, 256, requires_grad=True)
    assert allocation_peak_of(lambda: standins.cuda_dropout(x, 0.05)) == pytest.approx(5 * x.numel(), rel=0.01)
    assert allocation_peak_of(lambda: torch.native_dropout(x, 0.05, True)) == pytest.approx(9 * x.numel(), rel=0.01)


def test_flex_attentions_block_mask_is_what_torch_builds():
    """The BlockMask every layer's flex_attention reads to the end of backward: torch's create_block_mask's
    tensors (CPU builds the same), against the plan's count, at lengths on and off its 128-token blocks, causal or
    through a sliding window (its tensors as large). A model with both kinds of layer (Gemma 3) holds one of each:
    the plan counts two."""
    from torch.nn.attention.flex_attention import create_block_mask

    from memrecipe.planning.activations import activation_bytes, activation_mode
    from memrecipe.planning.attention import block_mask_bytes

    for length in (8192, 8000):
        for visible in (lambda b, h, q, k: q >= k, lambda b, h, q, k: (q >= k) & (q - k < 1024)):
            mask = create_block_mask(visible, 1, None, length, length, device="cpu", _compile=False)
            held = sum(getattr(mask, name).nbytes for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                                                "full_kv_indices", "q_num_blocks", "q_indices",
                                                                "full_q_num_blocks", "full_q_indices"))
            assert block_mask_bytes("flex_attention", 1, length) == held
    assert block_mask_bytes("sdpa", 1, 8192) == 0
    r = load_recipe("single-gpu-lora", ["attn_implementation=flex_attention", "max_seq_length=8192"])
    gemma = {"model_type": "gemma3_text", "head_dim": 128}
    full, both = (structure(LLAMA_8B | gemma | windows) for windows in ({"sliding_window": None}, {}))
    assert [g.window for g in full.groups()] == [0] and [g.window for g in both.groups()] == [4096, 0]
    full, both = (activation_bytes(r, s, activation_mode(r, 2), 1, 8192, "flex_attention", cuda=True)["forward_saved"]
                  for s in (full, both))
    assert both - full == block_mask_bytes("flex_attention", 1, 8192)


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    """Sliding-window attention at the widened Llama's widths, a window of 256 keys: Mistral's in every layer, and
    Gemma 3's beside a full-attention layer (the first: the LoRA model's first layer computes no input gradient,
    and the window's place is the second's)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, MistralConfig

    made = {}
    for kind, config, extra in (("mistral", MistralConfig, {}),
                                ("gemma3", Gemma3TextConfig, {"layer_types": ["full_attention", "sliding_attention"]})):
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(kind)
        AutoModelForCausalLM.from_config(config(**WIDE, **extra, vocab_size=512, max_position_embeddings=4096,
                                                sliding_window=256, eos_token_id=None, pad_token_id=None,
                                                bos_token_id=None)).save_pretrained(folder)
        made[kind] = str(folder)
    return made


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
@pytest.mark.parametrize("rung", ["full", "none"])
@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_a_sliding_window_under_sdpa_is_planned_with_its_dense_mask(sliding, kind, rung, precision):
    """Rows longer than a layer's sliding window under sdpa: transformers builds that layer kind's boolean [S x S]
    mask once a forward (kept by the checkpoints), and each sliding layer's sdpa call its additive copy and K/V at
    every head, as for packed rows; Gemma 3's full-attention layer runs causal beside it. The plan is the step's peak
    within 2% at 1,024 and 2,048 tokens (without the window: 0.71x Mistral's peak at 2,048 under full checkpointing,
    0.79-0.89x Gemma 3's with five sliding layers of six), in bf16 as shipped, and in fp32 within 5% (the mask's
    additive copy 4 bytes a score; LoRA in fp32 plans 1.02-1.04x without a window, the next test). Query chunks take
    the window's layers in chunks too, without the mask."""
    from helpers import loop_model
    from measuring import step_peak
    from memrecipe.planning.activations import activation_bytes, activation_mode
    from memrecipe.planning.attention import chunked

    s = structure(read_config(sliding[kind]))
    for length in (1024, 2048):
        r = load_recipe("single-gpu-lora", [*LADDER[rung], f"max_seq_length={length}", "packing=false",
                                            "attn_implementation=sdpa", "per_device_train_batch_size=1",
                                            "optimizer_in_backward=false", "lora.dropout=0",
                                            f"mixed_precision={precision}"])
        model, _ = loop_model(r, sliding[kind], precision)
        model.train()
        ids = torch.randint(0, s.vocab, (1, length), generator=torch.Generator().manual_seed(0))
        b = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids),
             "position_ids": torch.arange(length)[None]}
        plan = activation_bytes(r, s, activation_mode(r, 2 if precision == "bf16" else 4), 1, length)["working"]
        peak = step_peak(model, b, autocast=precision == "bf16")
        assert plan == pytest.approx(peak, rel=0.02 if precision == "bf16" else 0.05), length  # (fp32: below)
    # under query chunks every layer runs in chunks, the window's without its mask (training.query_chunks)
    assert [chunked(256, "sdpa", False, 1, 2048, g.window) for g in s.groups()] == [256] * len(s.groups())


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_a_sliding_window_in_query_chunks_is_planned_without_its_mask(sliding, kind):
    """Under query_chunks a windowed layer's rows get no mask (training.query_chunks.windowless_mask) and each chunk
    runs against the keys its window reaches (BandedAttention): the plan is the step's peak within 2% at 1,024 and
    2,048 tokens in bf16, as shipped (0.998-0.999x measured for Mistral), and below the masked step's."""
    from helpers import loop_model
    from measuring import step_peak
    from memrecipe.planning.activations import activation_bytes, activation_mode

    s = structure(read_config(sliding[kind]))
    for length in (1024, 2048):
        plans = []
        for chunks in ("false", "256"):
            r = load_recipe("single-gpu-lora", [f"max_seq_length={length}", "packing=false", "attn_implementation=sdpa",
                                                "per_device_train_batch_size=1", "optimizer_in_backward=false",
                                                "lora.dropout=0", "mixed_precision=bf16", f"query_chunks={chunks}"])
            plans.append(activation_bytes(r, s, activation_mode(r, 2), 1, length)["working"])
        model, _ = loop_model(r, sliding[kind], "bf16")
        model.train()
        ids = torch.randint(0, s.vocab, (1, length), generator=torch.Generator().manual_seed(0))
        b = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids),
             "position_ids": torch.arange(length)[None]}
        assert plans[1] == pytest.approx(step_peak(model, b, autocast=True), rel=0.02), length
        assert plans[1] < plans[0]
