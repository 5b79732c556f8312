"""planning/activations.py: the bytes a micro batch saves for backward, held to what autograd really saves
(saved_tensors_hooks) on the embedded model and a ~55M one, per layer, with checkpointing, and under top-k routing."""

import pytest

from measuring import activation_case
from model_configs import MOE_LORA

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
