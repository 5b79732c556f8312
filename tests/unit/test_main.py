"""The CLI as a user meets it (main.py, the click group, and the package's import-time settings): fast paths import
no torch; bad input is one line, exit 2."""

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

HEAVY = ("torch", "transformers", "deepspeed", "accelerate", "datasets", "peft", "bitsandbytes", "torchao")
LLAMA_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False}


@pytest.mark.parametrize("args", [["--help"], ["ls"], ["show", "fsdp"], ["config", "zero3-offload", "--num-processes", "8"],
                                  ["plan", "--gpu-memory", "24GiB", "--host-memory", "64GiB"],
                                  ["plan", "--model", "LLAMA", "--gpu-memory", "80GB", "--host-memory", "512GiB"],
                                  ["validate", "REPO/recipes/fsdp.yaml"], ["validate", "REPO/recipes/zero3-offload.yaml"],
                                  ["config", "--help"], ["run", "--help"],
                                  ["slurm", "fsdp", "--nodes", "2", "--gpus-per-node", "8", "--output-dir", "TMP"]])
def test_fast_paths_import_no_torch(args, tmp_path):
    """The planning side's commands (and the help texts) import none of the training libraries."""
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(LLAMA_8B))
    words = {"TMP": str(tmp_path / "out"), "LLAMA": str(tmp_path / "llama")}
    args = [words.get(a, a.replace("REPO", str(REPO))) for a in args]
    code = textwrap.dedent(f"""
        import sys
        from memrecipe.main import main
        try:
            main({args!r})
        except SystemExit as e:
            assert e.code in (0, None), e.code
        heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)
        assert not heavy, heavy
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_planning_and_launching_sides_import_no_torch():
    """The torch line: no module of memrecipe.planning or memrecipe.launching imports a training library,
    directly or through what it imports; and no planning module imports one lazily either, nor the
    training side, but for the one exception: architecture's meta-device read of a model type it has no
    reader for (memrecipe.training.meta)."""
    code = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        import memrecipe.planning, memrecipe.launching
        for package in (memrecipe.planning, memrecipe.launching):
            for module in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
                importlib.import_module(module.name)
        heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)
        assert not heavy, heavy
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    reached = []
    for path in sorted((REPO / "cli" / "memrecipe" / "planning").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["." * node.level + (node.module or "")]
            else:
                continue
            reached += [(path.name, name) for name in names
                        if name.split(".")[0] in HEAVY or name.startswith("..training")]
    assert reached == [("architecture.py", "..training.meta")] * 2, reached


def _bad_inputs(tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "fsdp_8gpu.yaml").write_text("keep me\n")
    not_yaml = tmp_path / "broken.yaml"
    not_yaml.write_text("name: [unclosed\n")
    unknown_key = tmp_path / "unknown.yaml"
    unknown_key.write_text("name: mine\nlerning_rate: 0.1\nsupports: {max_processes: 1}\n")
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    broken_template = tmp_path / "chat.jinja"
    broken_template.write_text("{% for m in messages %}{{ m.content")
    unclosed = json.dumps([{"path": str(tmp_path / "a.jsonl"), "columns": {"prompt": "{instruction"}}])
    run = ["run", "sft", "--recipe", "single-gpu-lora", "--output-dir"]  # each into a folder that must not appear
    return [
        (["show", "fsdpp"], "did you mean 'fsdp'"),
        (["config", "zero3-ofload"], "did you mean 'zero3-offload'"),
        (["config", "fsdp", "lora.rr=8"], "did you mean 'lora.r'"),
        (["config", "fsdp", "learning_rate=fast"], "learning_rate must be a number"),
        (["config", "fsdp", "optim=adamw_bnb_8bit"], "DTensor"),
        (["config", "zero3-offload", "optim=paged_adamw_8bit"], "CPU Adam"),
        (["config", "single-gpu-lora", "--num-processes", "8"], "at most 1 process"),
        (["config", "fsdp", "--num-processes", "1"], "at least 2 processes"),
        (["config", "fsdp", "--num-processes", "8", "--num-machines", "3", "--main-process-ip", "h"], "divide evenly"),
        (["config", "fsdp", "--num-processes", "16", "--num-machines", "2"], "--main-process-ip"),
        (["config", "fsdp", "--num-processes", "8", "--output-dir", str(existing)], "already exists"),
        (["config", "fsdp", "--num-processes", "8", "--output-dir", str(existing / "fsdp_8gpu.yaml" / "sub")],
         "cannot write"),  # under a file: unwritable even for root
        (["config", "fsdp", "max_steps"], "not key=value"),
        (["config", "fsdp", "--num-processes", "two"], "'two' is not a valid integer"),
        (["config", "fsdp", "--bogus"], "No such option"),
        (["conifg", "fsdp"], "did you mean 'config'"),
        (["show", str(not_yaml)], "not valid YAML at line"),
        (["validate", str(unknown_key)], "did you mean 'learning_rate'"),
        (["validate", str(scalar)], "must hold a mapping"),
        (["validate", str(tmp_path / "missing.yaml")], "does not exist"),
        (["config"], "Missing argument"),
        (["config", "fsdp", "--output-dir", str(not_yaml)], "is a file, not a folder: write elsewhere"),
        (["run", "sft", "--recipe", "single-gpu-lora", "--output-dir", str(not_yaml)],
         "is a file, not a folder: pick another --output-dir"),
        ([*run, str(tmp_path / "run-unclosed"), f"dataset={unclosed}"],
         "dataset[0].columns.prompt: the template '{instruction' is not a {column} template"),
        ([*run, str(tmp_path / "run-empty"), "dataset=[]"], "dataset is an empty list"),
        ([*run, str(tmp_path / "run-jinja"), f"chat_template={broken_template}"],
         f"chat_template {broken_template} is not valid Jinja (line 1: unexpected end of template"),
    ]


def test_bad_input_is_one_line_exit_2_no_traceback(cli, tmp_path):
    cases = _bad_inputs(tmp_path)
    assert len(cases) >= 15
    for args, words in cases:
        done = cli(*args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (args, done.stderr)
        assert len(lines) == 1, (args, done.stderr)
        assert "Traceback" not in done.stderr
        assert lines[0].startswith("memrecipe: error: ") and words in lines[0], (args, lines[0])
    assert (tmp_path / "existing" / "fsdp_8gpu.yaml").read_text() == "keep me\n"
    assert not list(tmp_path.glob("run-*"))  # refused before any run folder is made


@pytest.mark.parametrize("given, expected", [
    ({}, "PYTORCH_ALLOC_CONF=expandable_segments:True,pinned_max_cached_size_mb:64"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128"),
    ({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}, "PYTORCH_ALLOC_CONF=backend:cudaMallocAsync"),
])
def test_the_cuda_allocator_grows_segments_in_place_unless_the_user_configured_it(given, expected):
    """Set by importing memrecipe, before torch is: what the loop (however launched) and a `memrecipe run`
    launch run with; the one a user gave is kept, under either name torch reads."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    code = ("import os, memrecipe; print(', '.join(f'{k}={os.environ[k]}' for k in "
            "('PYTORCH_ALLOC_CONF', 'PYTORCH_CUDA_ALLOC_CONF') if k in os.environ))")
    done = subprocess.run([sys.executable, "-c", code], env={**env, **given}, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == expected, done.stderr


def test_the_default_allocator_settings_are_keys_torch_parses():
    """A key torch does not know is ignored off CUDA and refused on it: each of memrecipe's is one of the keys
    torch's c10 allocator config reads (a string of its library)."""
    from pathlib import Path

    import torch

    from memrecipe import PINNED_CACHE_MB

    c10 = next((Path(torch.__file__).parent / "lib").glob("libc10.*")).read_bytes()
    for setting in ("expandable_segments:True", f"pinned_max_cached_size_mb:{PINNED_CACHE_MB}"):
        assert setting.split(":")[0].encode() in c10, setting
