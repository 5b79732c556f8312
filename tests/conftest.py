import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# One lane per core: `pytest -n N` (the suite's default, pyproject's addopts) runs N workers, and each worker is pinned
# to a core of its own before torch is imported, so that it and every run it launches compute on that core with one
# thread (the launcher reads the cores it may use). Unpinned, two workers' launches and in-process steps would share
# both cores with two threads each, and a small matmul waits for a descheduled thread: ~60x slower measured here.
# The cores the whole test run may use are kept for the runs of several processes (helpers.pin).
if os.environ.get("PYTEST_XDIST_WORKER"):
    _cores = sorted(os.sched_getaffinity(0))
    os.environ["TESTS_CORES"] = ",".join(map(str, _cores))
    os.sched_setaffinity(0, {_cores[int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")) % len(_cores)]})

# No hub here: every test builds its models and data locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session", autouse=True)
def bf16_matmuls():
    """In-process bf16 compute as the runs do it on this CPU (training.cpu_matmul: fp32 GEMMs where the CPU has no
    bf16 GEMM, ~15x faster; nothing changes where it has one)."""
    from memrecipe.training.cpu_matmul import bf16_matmuls_in_fp32

    return bf16_matmuls_in_fp32()


def run_cli(*args, cwd=None, env=None, timeout=180, preexec_fn=None):
    """Run `python -m memrecipe ARGS` as a user would; returns the CompletedProcess (`preexec_fn`: helpers.pin's, for
    a run of several processes)."""
    return subprocess.run([sys.executable, "-m", "memrecipe", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout, preexec_fn=preexec_fn)


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


def pytest_collection_modifyitems(items):
    """The files that launch processes (a test marked slow) first, in collection order, then the rest: a lane that
    takes a launching file near the end would run on alone (a file goes whole to one lane, pyproject's addopts), while
    many small in-process files even the lanes out."""
    launching = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in launching)  # (a stable sort: each file's tests stay in their order)
