"""Shared by tests and the worker scripts they launch: tiny models, uneven data, launching."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"


def loop_model(recipe, model_path, precision="no", device=None, device_mesh=None, run_folder=None):
    """The model as the loop builds it (recipes/sft.py's own setup_model: memory techniques, LoRA, compile, the
    fused head), outside a launch. Returns (model, activation offload hooks or None)."""
    import tempfile
    from types import SimpleNamespace

    if str(RECIPES) not in sys.path:
        sys.path.insert(0, str(RECIPES))
    from sft import setup_model

    accelerator = SimpleNamespace(mixed_precision=precision, device=device or torch.device("cpu"),
                                  torch_device_mesh=device_mesh, is_main_process=True)
    folder = Path(run_folder or tempfile.mkdtemp(prefix="memrecipe-loop-model-"))
    model, offload, _ = setup_model(recipe, model_path, accelerator, SimpleNamespace(
        initial_adapter=folder / "initial_adapter"), lambda *a, **k: None)
    return model, offload


def tiny_model(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def uneven_examples(n=8, seed=1):
    """n sequences of very different lengths, each with a masked prompt of different length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(4, 40, (1,), generator=g))
        prompt = int(torch.randint(1, length - 2, (1,), generator=g))
        ids = torch.randint(0, 64, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    env.update(extra)
    return env


def launch(args, cwd=None, env=None, timeout=600):
    """Run `accelerate launch ARGS` (or any command list); returns the CompletedProcess."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *args] if args and args[0] != "memrecipe" else \
        [sys.executable, "-m", "memrecipe", *args[1:]]
    return subprocess.run(cmd, cwd=cwd, env=env or child_env(), capture_output=True, text=True, timeout=timeout)
