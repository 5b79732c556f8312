"""FSDP and DeepSpeed scale gradients their own way; the loop's normalisation makes their first step's
gradient equal a 1-process run of the same global batch (fp32, the same 16 sequences per step).

Gradients, not losses after a few updates: AdamW (with clipping) is blind to a constant scale of the
gradient, so a missing x processes or x accumulation factor would leave the losses equal. Each run is
the loop's own first window (tests/workers/first_step_gradients.py), read before the optimizer.
Stated tolerance: 1e-5 absolute on every gradient element (reductions run in another order)."""

import subprocess
import sys

import pytest
import torch

from helpers import REPO, child_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SAME = ["mixed_precision=no", "warmup_ratio=0.0", "eval_size=0.1", "per_device_train_batch_size=4"]


def first_gradients(tmp_path, recipe, processes, accumulation):
    words = [*SAME, f"gradient_accumulation_steps={accumulation}"]
    folder = tmp_path / f"{recipe}-{processes}"
    config = subprocess.run([sys.executable, "-m", "memrecipe", "config", recipe, "--cpu", "--num-processes",
                             str(processes), "--output-dir", str(folder), *words], capture_output=True, text=True,
                            env=child_env())
    assert config.returncode == 0, config.stderr
    yaml_file, = (f for f in folder.glob("*.yaml") if f.stem != recipe)
    env = child_env(ACCELERATE_USE_CPU="true") if processes > 1 and not recipe.startswith("zero") else child_env()
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml_file),
                           str(REPO / "tests" / "workers" / "first_step_gradients.py"), str(folder / "out.pt"), recipe,
                           *words], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(folder / "out.pt", weights_only=False)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    # 1 process x 4 sequences x 4 accumulation = 16 sequences per step, plain AdamW
    return first_gradients(tmp_path_factory.mktemp("one"), "ddp", 1, 4)


@pytest.mark.parametrize("recipe", ["fsdp", "zero3-offload"])
def test_first_gradients_equal_one_process(tmp_path, one_process, recipe):
    # 2 processes x 4 sequences x 2 accumulation = the same 16 sequences per step
    sharded = first_gradients(tmp_path, recipe, 2, 2)
    assert sharded["processes"] == 2 and sharded["distributed_type"] == {"fsdp": "FSDP"}.get(recipe, "DEEPSPEED")
    assert sharded["targets"] == one_process["targets"]  # the same window of target tokens
    assert sharded["loss"] == pytest.approx(one_process["loss"], abs=1e-5)
    expected, got = one_process["grads"], sharded["grads"]
    assert expected.keys() == got.keys(), sorted(set(expected) ^ set(got))[:4]
    assert len(expected) > 30
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=0, msg=name)
    assert max(g.abs().max() for g in expected.values()) > 1e-2  # gradients that a scale error would show in
