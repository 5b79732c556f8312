"""torch_compile: each decoder layer compiled in place gives the eager losses, with checkpointing and LoRA."""

from types import SimpleNamespace

import pytest
import torch

from helpers import loop_model
from memrecipe.training.data import Collator
from memrecipe.errors import RecipeError
from memrecipe.training.loss import count_targets, fuse_head, lm_loss
from memrecipe.training.loading import embedded_model
from memrecipe.training.optimizers import make_optimizer
from memrecipe.planning.registry import load_recipe


def losses(compiled: bool, steps: int = 4) -> tuple[list[float], object]:
    recipe = load_recipe("single-gpu-lora", ["mixed_precision=no", "lora.dropout=0.0",
                                             f"torch_compile={str(compiled).lower()}"])
    assert recipe.gradient_checkpointing
    torch.manual_seed(0)
    model, _ = loop_model(recipe, embedded_model(), "no")
    fuse_head(model)  # as the loop does: the head stays eager, outside the compiled layers
    optimizer = make_optimizer(recipe, model, SimpleNamespace(device=torch.device("cpu")))
    collate = Collator(0, 64)
    generator, out = torch.Generator().manual_seed(1), []
    model.train()
    for _ in range(steps):  # rows of different lengths, padded to 64: one shape, one graph
        rows = [torch.randint(4, 500, (int(n),), generator=generator).tolist()
                for n in torch.randint(20, 60, (2,), generator=generator)]
        batch = collate([{"input_ids": r, "labels": r} for r in rows])
        assert batch["input_ids"].shape[1] == 64
        loss = lm_loss(model, batch) / count_targets(batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    return out, model


@pytest.mark.slow
def test_compiled_layers_train_to_the_eager_losses():
    import torch._dynamo.utils

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # (process-wide: an earlier test's compile, e.g. flex_attention's, counts)
    eager, _ = losses(compiled=False)
    compiled, model = losses(compiled=True)
    assert compiled == pytest.approx(eager, abs=1e-4) and eager[-1] != eager[0]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one graph serves every layer and step
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert len(layers) == 4 and all(m._compiled_call_impl is not None for m in layers)
    assert not any("_orig_mod" in name for name in model.state_dict())  # saved and resumed under its own names


def test_compile_is_refused_where_it_is_not_supported(monkeypatch):
    from memrecipe.training.accelerator import make_accelerator

    with pytest.raises(RecipeError, match="torch_compile is not supported under FSDP"):
        load_recipe("fsdp-lora", ["torch_compile=true"])
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")  # a user's accelerate config with dynamo_config
    with pytest.raises(RecipeError, match="remove dynamo_config and set torch_compile: true"):
        make_accelerator(load_recipe("single-gpu-lora"))
