"""Gradient accumulation is exact: micro batch x accumulation (x processes) equals one big batch,
with sequences of very uneven length, in fp32."""

import sys

import pytest
import torch

from helpers import RECIPES, free_port, launch, child_env, tiny_model, uneven_examples
from memrecipe.training.data import Collator, pack
from memrecipe.training.loss import token_loss
from memrecipe.training.accelerator import make_accelerator
from memrecipe.planning.registry import load_recipe

sys.path.insert(0, str(RECIPES))
from sft import accumulate_window  # noqa: E402


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def accelerator():
    return make_accelerator(load_recipe("single-gpu-lora", ["mixed_precision=no"]))


def full_batch_grads(accelerator, examples):
    model = tiny_model()
    accelerator.gradient_accumulation_steps = 1
    accumulate_window(model, [Collator(0)(examples)], accelerator)
    return grads_of(model)


def test_micro_batches_with_accumulation_equal_the_full_batch(accelerator):
    examples = uneven_examples(8)
    reference = full_batch_grads(accelerator, examples)
    for micro in (1, 2, 4):
        model = tiny_model()
        accelerator.gradient_accumulation_steps = 8 // micro
        window = [Collator(0)(examples[i: i + micro]) for i in range(0, 8, micro)]
        loss, targets = accumulate_window(model, window, accelerator)
        assert targets == sum(sum(label != -100 for label in ex["labels"][1:]) for ex in examples)
        for name, grad in grads_of(model).items():
            torch.testing.assert_close(grad, reference[name], atol=1e-5, rtol=1e-4, msg=f"{name}, micro {micro}")


def test_packed_rows_with_accumulation_equal_the_unpacked_full_batch(accelerator):
    """Packing changes the batches' shape, not what is learned: rows of whole documents, windowed over
    micro batches of 1 and 2 rows, give the gradient of the unpacked batch of the same documents."""
    from datasets import Dataset

    examples = uneven_examples(8)
    reference = full_batch_grads(accelerator, examples)
    rows = list(pack(Dataset.from_list(examples), 48))
    assert len(rows) < len(examples) and any(0 in row["position_ids"][1:] for row in rows)  # rows are shared
    for micro in (1, 2):
        model = tiny_model()
        window = [Collator(0)(rows[i: i + micro]) for i in range(0, len(rows), micro)]
        accelerator.gradient_accumulation_steps = len(window)
        loss, targets = accumulate_window(model, window, accelerator)
        assert targets == sum(sum(label != -100 for label in ex["labels"][1:]) for ex in examples)
        for name, grad in grads_of(model).items():
            torch.testing.assert_close(grad, reference[name], atol=1e-5, rtol=1e-4, msg=f"{name}, micro {micro}")


def test_averaging_per_micro_batch_would_be_wrong(accelerator):
    """The same data with the naive mean loss per micro batch gives other gradients: the test above can fail."""
    examples = uneven_examples(8)
    reference = full_batch_grads(accelerator, examples)
    model = tiny_model()
    for i in range(0, 8, 2):
        batch = Collator(0)(examples[i: i + 2])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        (token_loss(logits, batch["labels"]) / (batch["labels"][:, 1:] != -100).sum() / 4).backward()
    worst = max((grads_of(model)[n] - g).abs().max().item() for n, g in reference.items())
    assert worst > 1e-4


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("packed", [[], ["packed"]], ids=["padded", "packed"])
def test_two_process_ddp_equals_the_full_batch(tmp_path, accelerator, packed):
    out = tmp_path / "grads.pt"
    done = launch(["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
                   str(RECIPES.parent / "tests" / "workers" / "ga_ddp.py"), str(out), *packed],
                  env=child_env(ACCELERATE_USE_CPU="true"))
    assert done.returncode == 0, done.stderr[-3000:]
    ddp = torch.load(out)
    reference = full_batch_grads(accelerator, uneven_examples(8))
    for name, grad in reference.items():
        torch.testing.assert_close(ddp[name], grad, atol=1e-5, rtol=1e-4, msg=name)
