"""FSDP and DeepSpeed scale gradients their own way; the loop's normalisation makes their first step's
gradient equal a 1-process run of the same global batch (fp32, the same 8 rows per step). And epochs end
alike: over two epochs of a row count that the global batch does not divide, every step's loss is the
1-process run's (the epoch's last partial global batch is left out on every topology; tests/unit/training/test_epochs.py).

Gradients, not losses after a few updates: AdamW (with clipping) is blind to a constant scale of the
gradient, so a missing x processes or x accumulation factor would leave the losses equal. Each run is
the loop's own loader and windows (tests/workers/first_step_gradients.py), the first read before the optimizer.
Stated tolerance: 1e-5 absolute on every gradient element and loss (reductions run in another order)."""

import subprocess
import sys

import pytest
import torch

from helpers import REPO, SideBySide, child_env, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
# constant learning rate, no clipping; the embedded chat set packs into 38 rows: 4 steps of 8 per epoch, 6 left out;
# lean norms (training/norms.py: each norm weight's gradient comes from its own autograd function, which every engine
# must reduce and shard as it does autograd's)
SAME = ["mixed_precision=no", "warmup_ratio=0.0", "lr_scheduler_type=constant", "max_grad_norm=null", "eval_size=0",
        "learning_rate=1e-3", "seed=7", "lean_norms=true"]


def run(tmp_path, recipe, processes, micro, accumulation):
    words = [*SAME, f"per_device_train_batch_size={micro}", f"gradient_accumulation_steps={accumulation}"]
    folder = tmp_path / f"{recipe}-{processes}"
    config = subprocess.run([sys.executable, "-m", "memrecipe", "config", recipe, "--cpu", "--num-processes",
                             str(processes), "--output-dir", str(folder), *words], capture_output=True, text=True,
                            env=child_env())
    assert config.returncode == 0, config.stderr
    yaml_file, = (f for f in folder.glob("*.yaml") if f.stem != recipe)
    env = child_env(ACCELERATE_USE_CPU="true") if processes > 1 and not recipe.startswith("zero") else child_env()
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml_file),
                           "--main_process_port", str(free_port()),
                           str(REPO / "tests" / "workers" / "first_step_gradients.py"), str(folder / "out.pt"), recipe,
                           *words], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(folder / "out.pt", weights_only=False)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """1 process x 4 rows x 2 accumulation = 8 rows per step, plain AdamW; and each engine's 2 processes x 2 rows x 2
    accumulation = the same 8 rows per step: launched two at a time."""
    base = tmp_path_factory.mktemp("engines")
    jobs = SideBySide({"one": lambda core: run(base, "ddp", 1, 4, 2),
                       **{recipe: (lambda core, recipe=recipe: run(base, recipe, 2, 2, 2))
                          for recipe in ("ddp", "fsdp", "zero3-offload")}})
    yield jobs
    jobs.close()


@pytest.fixture(scope="module")
def one_process(launched):
    return launched("one")


@pytest.mark.parametrize("recipe", ["ddp", "fsdp", "zero3-offload"])
def test_first_gradients_and_two_epochs_equal_one_process(launched, one_process, recipe):
    sharded = launched(recipe)
    assert sharded["processes"] == 2 and sharded["distributed_type"] == {"fsdp": "FSDP", "ddp": "MULTI_CPU"}.get(
        recipe, "DEEPSPEED")
    assert sharded["targets"] == one_process["targets"]  # the same window of target tokens
    assert sharded["loss"] == pytest.approx(one_process["loss"], abs=1e-5)
    expected, got = one_process["grads"], sharded["grads"]
    assert expected.keys() == got.keys(), sorted(set(expected) ^ set(got))[:4]
    assert len(expected) > 30
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=0, msg=name)
    assert max(g.abs().max() for g in expected.values()) > 1e-2  # gradients that a scale error would show in
    rows = one_process["rows"]
    assert rows % 8 and len(one_process["losses"]) == 2 * (rows // 8)  # two epochs of whole global batches
    assert sharded["losses"] == pytest.approx(one_process["losses"], abs=1e-5)  # every step, both epochs
