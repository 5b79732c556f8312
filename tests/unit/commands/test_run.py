"""`memrecipe run` (commands/run.py) before and after a launch, without training: the dry run, the one-line refusals,
and what a stop signal says (runs that train: tests/runs/test_run_cli.py)."""

import pytest


def test_dry_run_prints_the_command_and_writes_nothing(tmp_path, cli):
    out = tmp_path / "run"
    done = cli("run", "sft", "--recipe", "fsdp", "--output-dir", str(out), "--dry-run", "max_steps=5")
    assert done.returncode == 0, done.stderr
    assert "ACCELERATE_USE_CPU=true" in done.stdout and "launch --config_file accelerate_config.yaml" in done.stdout
    assert "--num_cpu_threads_per_process 1" in done.stdout and "--recipe recipe.yaml" in done.stdout
    assert "max_steps: 5" in done.stdout and "distributed_type: FSDP" in done.stdout
    assert not out.exists()
    ds = cli("run", "sft", "--recipe", "zero3-offload", "--output-dir", str(out), "--dry-run")
    command = next(line for line in ds.stdout.splitlines() if "accelerate launch" in line or "launch --config" in line)
    assert "ACCELERATE_USE_CPU" not in command  # it would switch DeepSpeed off
    assert f"# memrecipe run would create it, write the 3 file(s) shown below into {out}, then run:" in ds.stdout
    assert "deepspeed_config_file: deepspeed_config.json" in ds.stdout
    # a GPU launch line previewed on a 2-core machine: shown, with what a run here would be refused for
    eight = cli("run", "sft", "--recipe", "fsdp", "--num-processes", "8", "--output-dir", str(out), "--dry-run")
    assert eight.returncode == 0 and "num_processes: 8" in eight.stdout and "launch --config_file" in eight.stdout
    assert "a run on this machine would be refused: 8 CPU processes need 8 cores" in eight.stderr
    assert not out.exists()


def test_a_gated_model_names_hf_token(monkeypatch):
    import transformers

    from memrecipe.errors import RecipeError
    from memrecipe.training.loading import check_model

    def gated(*args, **kwargs):
        raise OSError("You are trying to access a gated repo. Make sure to have access to it at "
                      "https://huggingface.co/meta-llama/Llama-3.1-8B. 401 Client Error.")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", gated)
    with pytest.raises(RecipeError, match="gated: accept its licence on the hub and set HF_TOKEN"):
        check_model("meta-llama/Llama-3.1-8B")


def test_unknown_script_gets_did_you_mean(cli):
    done = cli("run", "stf", "--recipe", "fsdp")
    assert done.returncode == 2 and "did you mean 'sft'" in done.stderr


@pytest.mark.parametrize("recipe, overrides, reason", [
    ("fsdp-qlora", [], "FSDP1 wants a CUDA compute device"),
    ("fsdp", ["fsdp.offload_params=true"], "FSDP parameter offload needs an accelerator"),
    ("fsdp", ["supports.cpu=false"], "the recipe says supports.cpu: false"),
])
def test_a_gpu_only_recipe_is_refused_on_cpu_with_the_reason(cli, recipe, overrides, reason):
    done = cli("run", "sft", "--recipe", recipe, "--dry-run", *overrides)
    assert done.returncode == 2 and "is GPU-only: " + reason in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and f"memrecipe config {recipe} (no --cpu)" in done.stderr


def test_a_cuda_only_attention_on_cpu_names_the_key_not_the_recipe(cli):
    done = cli("run", "sft", "--recipe", "single-gpu-lora", "--dry-run", "attn_implementation=flash_attention_2")
    assert done.returncode == 2 and done.stderr.startswith("memrecipe: error: attn_implementation=flash_attention_2 "
                                                           "trains on CUDA only") and "GPU-only" not in done.stderr
    assert "attn_implementation=auto runs sdpa here: set it so" in done.stderr


def test_supports_cpu_agrees_with_what_is_known_to_fail_on_cpu():
    from memrecipe.planning.registry import load_recipe, recipe_names

    for name in recipe_names():
        r = load_recipe(name)
        blocker = r.cpu_blocker
        assert (blocker is None) == r.supports.cpu, name
        assert blocker is None or "supports.cpu" not in blocker, f"{name}: GPU-only without a measured reason"


@pytest.mark.parametrize("when", ["finished", "checkpointed", "before any checkpoint"])
def test_a_signal_says_whether_there_is_a_checkpoint_to_resume(tmp_path, monkeypatch, when):
    """A Ctrl-C that lands while the run writes its final save and report is no stop to resume from; one before any
    checkpoint was complete (early in a run, or torchrun's kill before the save ended) leaves nothing to resume."""
    import os
    import signal as signals
    import time

    from click.testing import CliRunner

    from memrecipe.commands import run as command
    from memrecipe.launching.runner import Outcome
    from memrecipe.main import cli

    def fake_start(plan, overwrite, say):
        plan.folder.mkdir(parents=True)
        if when == "finished":  # stamped a second before the start, as a coarse file-system clock can make it look
            (plan.folder / "report.json").write_text("{}")
            os.utime(plan.folder / "report.json", (time.time() - 1, time.time() - 1))
        (plan.folder / "checkpoints" / "step-3").mkdir(parents=True)  # one being written ...
        if when == "checkpointed":
            (plan.folder / "checkpoints" / "step-3" / "trainer_state.json").write_text("{}")  # ... and complete
        return Outcome(status=0 if when == "finished" else 130, stopped_by=signals.SIGINT, error=None)

    monkeypatch.setattr(command, "start", fake_start)
    done = CliRunner().invoke(cli, ["run", "sft", "--recipe", "single-gpu-lora", "--cpu", "--output-dir",
                                    str(tmp_path / "R")])
    if when == "finished":
        assert done.exit_code == 0 and "SIGINT came after the run had finished" in done.output
        assert "--resume" not in done.output
    elif when == "checkpointed":
        assert done.exit_code == 128 + signals.SIGINT and "resume with: memrecipe run sft --resume" in done.output
    else:
        assert done.exit_code == 128 + signals.SIGINT and "--resume" not in done.output
        assert (f"memrecipe: stopped by SIGINT before any checkpoint was complete: nothing to resume ({tmp_path / 'R'} "
                "keeps its log; --overwrite starts the run there again)") in done.output


def test_ring_attention_on_cpu_names_the_key_not_the_recipe(cli):
    """fsdp-lora runs on CPU; only its parallelism.cp_size does not: the refusal says which, and how to run here."""
    done = cli("run", "sft", "--recipe", "fsdp-lora", "--num-processes", "2", "--dry-run", "parallelism.cp_size=2",
               "packing=false")
    assert done.returncode == 2 and done.stderr.startswith("memrecipe: error: parallelism.cp_size=2 is GPU-only: ")
    assert "set parallelism.cp_size=1 to run the recipe here" in done.stderr and "recipe fsdp-lora is" not in done.stderr


def test_a_dry_run_of_a_model_folder_with_only_its_config_checks_the_rest_and_says_what_it_could_not(cli, tmp_path):
    """No GPU and no weights yet: the dry run of the real job's words goes through (the plan, the configs, the data),
    saying that the weights and the tokenizer were not there to check; the run itself still refuses."""
    import json

    from memrecipe.planning.registry import EMBEDDED_MODEL

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((EMBEDDED_MODEL / "config.json").read_text())
    dry = cli("run", "sft", "--recipe", "single-gpu-lora", "--model", str(model), "--dry-run", "max_seq_length=512")
    assert dry.returncode == 0, dry.stderr
    said = dry.stdout + dry.stderr
    assert f"note: {model} has a config.json and no weights yet: the dry run checked everything else" in said
    assert f"note: {model} has no tokenizer yet" in said and "accelerate launch" in said
    run = cli("run", "sft", "--recipe", "single-gpu-lora", "--model", str(model), "--output-dir", str(tmp_path / "r"))
    assert run.returncode == 2 and "has a config.json but no weights" in run.stderr and not (tmp_path / "r").exists()
    assert json.loads((model / "config.json").read_text())  # (nothing written into the model's folder)
