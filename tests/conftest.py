import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# No hub here: every test builds its models and data locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def run_cli(*args, cwd=None, env=None, timeout=180):
    """Run `python -m memrecipe ARGS` as a user would; returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "memrecipe", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """name -> folder of a saved random model: the embedded tiny one, a ~55M one and two mixtures of experts (built
    once a session, for the tests that hold the planner to what a model holds)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    from memrecipe.training.loading import embedded_model
    from model_configs import DENSE_FIRST, MEDIUM, SMALL, TINY_MIXTRAL

    folder = tmp_path_factory.mktemp("medium")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**MEDIUM)).save_pretrained(folder)
    mixtral = tmp_path_factory.mktemp("mixtral")
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_MIXTRAL)).save_pretrained(mixtral)
    dense_first = tmp_path_factory.mktemp("qwen2_moe")  # its first layer dense, the next two routed
    AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2_moe", **{**SMALL, "num_hidden_layers": 3, "pad_token_id": 0}, **DENSE_FIRST["qwen2_moe"])).save_pretrained(dense_first)
    return {"tiny": embedded_model(), "medium": str(folder), "mixtral": str(mixtral), "dense-first": str(dense_first),
            "dir": folder.parent}

