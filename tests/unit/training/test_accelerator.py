"""training/accelerator.py: the Accelerator as the recipe asks for it (its accumulation, a seeded sampler), and
what the launch config may not ask for, refused in one line. Its FSDP and DeepSpeed paths on CPU are the run tests'
(tests/runs)."""

import pytest
from accelerate.state import AcceleratorState

from memrecipe.errors import RecipeError
from memrecipe.planning.registry import load_recipe
from memrecipe.training.accelerator import make_accelerator


@pytest.fixture(autouse=True)
def fresh_state():
    AcceleratorState._reset_state(True)  # accelerate keeps one state per process
    yield
    AcceleratorState._reset_state(True)


def test_accumulation_and_the_seeded_sampler_are_the_recipes():
    recipe = load_recipe("single-gpu-lora", ["gradient_accumulation_steps=6", "seed=7"])
    accelerator = make_accelerator(recipe)
    assert accelerator.gradient_accumulation_steps == 6
    assert not accelerator.gradient_state.plugin_kwargs["sync_with_dataloader"]  # the loop builds its windows
    assert accelerator.dataloader_config.use_seedable_sampler and accelerator.dataloader_config.data_seed == 7


def test_a_launch_config_that_compiles_the_whole_model_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    with pytest.raises(RecipeError, match="remove dynamo_config and set torch_compile: true in the recipe"):
        make_accelerator(load_recipe("single-gpu-lora"))
