"""What is checked before a run starts: a run that will not fit is refused with what would fit instead."""

import json
from dataclasses import replace

import pytest

from memrecipe.errors import RecipeError
from memrecipe.planning.architecture import read_config, structure
from memrecipe.planning.planner import estimate, judge
from memrecipe.planning.registry import EMBEDDED_MODEL, load_recipe
from memrecipe.planning.topology import Topology
from model_configs import LLAMA_8B

CPU1 = Topology(1, cpu=True)


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


def test_run_suggests_a_recipe_of_the_same_method_first_and_says_when_it_cannot():
    from memrecipe.launching.checks import check_fits
    from memrecipe.planning.hardware import Machine

    gpu = Machine(gpus=1, gpu_memory=16 * 2**30, bf16=True, cores=16, host_memory=64 * 2**30)
    words = ["per_device_train_batch_size=2", "max_seq_length=2048"]
    with pytest.raises(RecipeError) as refused:
        check_fits(load_recipe("single-gpu-lora", words), Topology(1), gpu, words, force=False, shape=structure(LLAMA_8B))
    assert "qlora would fit" in str(refused.value) and "a QLoRA recipe: no LoRA recipe fits" in str(refused.value)
    with pytest.raises(RecipeError) as refused:  # a full fine-tune: the full fine-tune that fits, not LoRA's
        check_fits(load_recipe("adamw-8bit", words), Topology(1), replace(gpu, host_memory=512 * 2**30), words,
                   force=False, shape=structure(LLAMA_8B))
    assert "zero3-offload would fit" in str(refused.value) and "QLoRA" not in str(refused.value)
