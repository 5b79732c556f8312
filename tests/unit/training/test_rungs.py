"""training/rungs.py: the loop applies each rung the recipe stands on through its module's apply, at its point of the
setup (checkpointing before the LoRA adapters; the tiled MLP and lean norms over the adapted layers)."""

from types import SimpleNamespace

from helpers import tiny_model
from memrecipe.planning.registry import load_recipe
from memrecipe.training.facts import describe_setup
from memrecipe.training.rungs import apply_rungs

ACCELERATOR = SimpleNamespace(distributed_type=SimpleNamespace(value="NO"), num_processes=1, process_index=0,
                              device="cpu", mixed_precision="bf16", unwrap_model=lambda m: m)


def test_each_rung_is_applied_once_at_its_point_of_the_setup():
    top = load_recipe("single-gpu-lora", ["activation_offload=true", "lean_norms=true", "tiled_mlp=true"])
    model = tiny_model()
    before = apply_rungs(model, top, ACCELERATOR, after_adapters=False)
    assert set(before) == {"layers"} and before["layers"] is not None  # the offload's hooks, for the Meter
    facts = describe_setup(ACCELERATOR, model, None)
    assert (facts.gradient_checkpointing, facts.tiled_mlps, facts.lean_norms) == (True, 0, 0)
    after = apply_rungs(model, top, ACCELERATOR, after_adapters=True)
    assert after == {"norms": 5, "tiling": 2}  # 2 layers x 2 norms + the final one; 2 MLPs
    facts = describe_setup(ACCELERATOR, model, None)
    assert (facts.tiled_mlps, facts.lean_norms) == (2, 5)


def test_a_recipe_on_no_rung_is_left_as_it_is():
    model = tiny_model()
    assert apply_rungs(model, load_recipe("ddp", ["gradient_checkpointing=false"]), ACCELERATOR, False) == {}
    assert describe_setup(ACCELERATOR, model, None).gradient_checkpointing is False
    selective = load_recipe("ddp", ["gradient_checkpointing=selective"])
    assert apply_rungs(model, selective, ACCELERATOR, False) == {"layers": None}  # (no offload)
    assert describe_setup(ACCELERATOR, model, None).gradient_checkpointing == "selective"
