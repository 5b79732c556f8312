"""What is checked before a run starts: a run that will not fit is refused with what would fit instead."""

import re
from dataclasses import replace

import pytest

from memrecipe.errors import RecipeError
from memrecipe.planning.architecture import read_config, structure
from memrecipe.planning.planner import estimate, judge
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology
from model_configs import LLAMA_8B, model_folder

CPU1 = Topology(1, cpu=True)


def test_run_refuses_what_will_not_fit_and_names_what_would(cli, tmp_path):
    folder = model_folder(tmp_path / "llama-70b", {
        "model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
        "intermediate_size": 28672, "vocab_size": 128256, "num_hidden_layers": 80})
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


def test_deepspeeds_first_use_compile_is_said_before_it_happens_and_refused_without_a_compiler(tmp_path, monkeypatch):
    """zero2 on 2 CPU processes compiles DeepSpeed's CPU Adam and its shared-memory collectives the first time (~1-3
    silent minutes): a note says so before the launch, none once both are built; without ninja (or a compiler) one
    line names what is missing."""
    from memrecipe.errors import RecipeError
    from memrecipe.launching.checks import deepspeed_builds
    from memrecipe.planning.registry import load_recipe
    from memrecipe.planning.topology import Topology

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    recipe, two = load_recipe("zero2"), Topology(2, cpu=True)
    (note,) = deepspeed_builds(recipe, two)
    assert "its CPU Adam and its shared-memory collectives" in note and str(tmp_path) in note
    assert deepspeed_builds(load_recipe("fsdp"), two) == []
    for op in ("cpu_adam", "deepspeed_shm_comm"):
        (tmp_path / op).mkdir()
        (tmp_path / op / f"{op}.so").write_bytes(b"")
    assert deepspeed_builds(recipe, two) == []
    (tmp_path / "cpu_adam" / "cpu_adam.so").unlink()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no ninja, no compiler
    with pytest.raises(RecipeError, match=r"DeepSpeed compiles its CPU Adam on first use, and this machine lacks a C\+\+ "
                                          r"compiler \(g\+\+\), ninja \(pip install ninja\)"):
        deepspeed_builds(recipe, two)


def test_a_run_that_fits_a_rung_up_the_ladder_is_refused_naming_the_words_that_climb_it():
    from memrecipe.launching.checks import check_fits
    from memrecipe.planning.hardware import Machine

    gpu = Machine(gpus=1, gpu_memory=80 * 10**9, bf16=True, cores=16, host_memory=512 * 2**30)
    words = ["per_device_train_batch_size=1", "max_seq_length=131072"]
    with pytest.raises(RecipeError) as refused:
        check_fits(load_recipe("single-gpu-lora", words), Topology(1), gpu, words, force=False,
                   shape=structure(LLAMA_8B))
    assert "with activation offload it would (" in str(refused.value)
    assert str(refused.value).endswith("add activation_offload=true; --force launches anyway")
    offloaded = load_recipe("single-gpu-lora", [*words, "activation_offload=true"])
    assert check_fits(offloaded, Topology(1), gpu, words, force=False, shape=structure(LLAMA_8B))[1].fits


def test_a_long_run_on_a_kernel_that_keeps_s_by_s_tensors_is_refused_naming_the_kernels_that_keep_none():
    """sdpa over packed rows at 256K keeps a 128 GiB dense mask in every layer: the plan says which kernels this
    length needs, and the refusal names the rung that fits, sdpa's kernel on unpacked rows in query chunks; with a
    rule that refuses that rung (torch_compile) no rung fits, and the refusal is the plan's note. The plan of a
    kernel that keeps none says nothing of it."""
    from memrecipe.launching.checks import check_fits
    from memrecipe.planning.hardware import Machine

    gpu = Machine(gpus=1, gpu_memory=80 * 10**9, bf16=True, cores=16, host_memory=512 * 2**30)
    words = ["per_device_train_batch_size=1", "max_seq_length=262144", "attn_implementation=sdpa"]
    note = (r"attention: sdpa keeps 128\.0 GiB per layer in its \[262144 x 262144\] dense mask \(packed or padded "
            r"rows, or past a sliding window\): at this length use attn_implementation=flash_attention_2 .* or flex_attention")
    assert any(re.match(note, n) for n in estimate(load_recipe("single-gpu-lora", words), structure(LLAMA_8B),
                                                   Topology(1)).notes)
    with pytest.raises(RecipeError, match=r"with query chunks it would .* add .*packing=false query_chunks=true"):
        check_fits(load_recipe("single-gpu-lora", words), Topology(1), gpu, words, force=False,
                   shape=structure(LLAMA_8B))
    compiled = [*words, "torch_compile=true", "lora.dropout=0"]
    with pytest.raises(RecipeError, match=note):
        check_fits(load_recipe("single-gpu-lora", compiled), Topology(1), gpu, compiled, force=False,
                   shape=structure(LLAMA_8B))
    flex = estimate(load_recipe("single-gpu-lora", [*words[:2], "attn_implementation=flex_attention"]),
                    structure(LLAMA_8B), Topology(1))
    short = estimate(load_recipe("single-gpu-lora", ["max_seq_length=4096", "attn_implementation=sdpa"]),
                     structure(LLAMA_8B), Topology(1))
    assert not [n for n in (*flex.notes, *short.notes) if "keeps" in n and n.startswith("attention:")]


def test_a_sagemaker_accelerate_config_is_refused_in_one_line(tmp_path):
    """accelerate loads it as a SageMakerConfig, which has no num_processes: a traceback before, one line now."""
    from memrecipe.launching.checks import check_accelerate_config

    path = tmp_path / "sagemaker.yaml"
    path.write_text("compute_environment: AMAZON_SAGEMAKER\ndistributed_type: NO\nmixed_precision: bf16\n"
                    "ec2_instance_type: ml.p3.2xlarge\niam_role_name: role\nprofile: default\nregion: us-east-1\n"
                    "num_machines: 1\nbase_job_name: x\nuse_cpu: false\ndebug: false\n")
    with pytest.raises(RecipeError, match="a SageMaker config .* memrecipe writes and checks LOCAL_MACHINE configs"):
        check_accelerate_config(path)
