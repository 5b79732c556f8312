"""FSDP and DeepSpeed scale gradients their own way; the loop's normalisation makes their first
steps equal a 1-process run of the same global batch (fp32, the same 16 sequences per step).

Stated tolerance: every step's loss to 1e-5 absolute (measured: <= 3e-6; reductions run in
another order across processes, and DeepSpeed's CPU Adam is its own implementation)."""

import json

import pytest

from helpers import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SAME = ["mixed_precision=no", "max_steps=3", "learning_rate=1e-3", "warmup_ratio=0.05", "eval_size=0.1",
        "max_grad_norm=1.0", "per_device_train_batch_size=4", "weight_decay=0.0"]


def losses(folder, recipe, *args):
    done = launch(["memrecipe", "run", "sft", "--recipe", recipe, "--output-dir", str(folder), *args, *SAME])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    history = json.loads((folder / "report.json").read_text())["history"]
    return [h["loss"] for h in history]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    # 1 process x 4 sequences x 4 accumulation = 16 sequences per step, plain AdamW
    return losses(tmp_path_factory.mktemp("one"), "adamw-8bit", "--num-processes", "1", "optim=adamw_torch",
                  "gradient_accumulation_steps=4")


@pytest.mark.parametrize("recipe", ["fsdp", "zero3-offload"])
def test_first_updates_equal_one_process(tmp_path, one_process, recipe):
    # 2 processes x 4 sequences x 2 accumulation = the same 16 sequences per step
    sharded = losses(tmp_path / recipe, recipe, "--num-processes", "2", "gradient_accumulation_steps=2")
    assert sharded == pytest.approx(one_process, abs=1e-5)
    assert sharded[2] < sharded[0]  # and they did learn
