"""runner.plan_run, called directly: what `memrecipe run` checks and lays out before it touches the disk."""

from pathlib import Path

import pytest
import yaml

from memrecipe.errors import RecipeError
from memrecipe.launching.runner import plan_run
from memrecipe.planning.hardware import Machine
from memrecipe.units import GiB
from model_configs import LLAMA_8B, LLAMA_70B, model_folder

LAPTOP = Machine(gpus=0, gpu_memory=None, bf16=None, cores=2, host_memory=24 * GiB)
NODE = Machine(gpus=8, gpu_memory=80 * GiB, bf16=True, cores=96, host_memory=1024 * GiB)
CPU2 = {"num_processes": 2, "cpu": True}



def test_a_cpu_run_is_laid_out_with_its_files_command_and_environment(tmp_path):
    plan = plan_run("sft", "fsdp", ["max_steps=3"], tmp_path / "run", CPU2, machine=LAPTOP)
    assert plan.folder == tmp_path / "run" and plan.refused == ()
    recipe = yaml.safe_load(plan.files["recipe.yaml"])
    assert recipe["max_steps"] == 3 and recipe["name"] == "fsdp"
    config = yaml.safe_load(plan.files["accelerate_config.yaml"])
    assert config["num_processes"] == 2 and config["distributed_type"] == "FSDP"
    words = plan.command
    assert words[words.index("--config_file") + 1] == "accelerate_config.yaml"
    assert words[words.index("--num_cpu_threads_per_process") + 1] == "1"  # 2 cores, 2 processes
    assert Path(words[words.index("--recipe") - 1]).name == "sft.py" and words[-3:] == ["recipe.yaml", "--output-dir", "."]
    assert plan.env["ACCELERATE_USE_CPU"] == "true" and plan.env["MEMRECIPE_RUN"] == "1"
    assert plan.verdict.fits and "of host RAM" in plan.banner


def test_a_one_process_run_starts_the_loop_as_accelerates_simple_launcher_would(tmp_path):
    """One process: memrecipe starts the loop itself, with the command and environment accelerate's own launcher code
    gives for the run's files (its precision, threads and CPU mode); torchrun's and DeepSpeed's launches stay
    accelerate's processes."""
    from memrecipe.files import write_files
    from memrecipe.launching.launch import one_process

    def started(recipe, topology):
        folder = tmp_path / f"{recipe}-{topology.get('num_processes', 1)}"
        plan = plan_run("sft", recipe, [], folder, topology, machine=LAPTOP)
        write_files(plan.folder, plan.files)
        return plan, one_process(plan.command, plan.folder, plan.env)

    one, (command, env) = started("single-gpu-lora", {"cpu": True})
    assert command[1:] == one.command[one.command.index("--recipe") - 1:]  # python sft.py --recipe recipe.yaml ...
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and env["ACCELERATE_USE_CPU"] == "True"
    assert env["OMP_NUM_THREADS"] == "2" and env["MEMRECIPE_RUN"] == "1"  # its share of the cores; memrecipe's own
    one_deepspeed = {"cpu": True, "num_processes": 1}  # (DeepSpeed's launcher, torchrun, on one process too)
    for recipe, topology in (("fsdp", CPU2), ("zero3-offload", CPU2), ("zero3-offload", one_deepspeed)):
        assert started(recipe, topology)[1] is None, (recipe, topology)


def test_deepspeed_on_cpu_picks_its_own_accelerator_and_gpus_get_their_share_of_the_cores(tmp_path):
    cpu = plan_run("sft", "zero3-offload", [], tmp_path / "a", CPU2, machine=LAPTOP)
    assert "ACCELERATE_USE_CPU" not in cpu.env and cpu.env["DS_ACCELERATOR"] == "cpu"
    assert "deepspeed_config.json" in cpu.files
    gpu = plan_run("sft", "zero3-offload", [], tmp_path / "b", {"num_processes": 8}, dry_run=True, machine=NODE)
    assert gpu.env["OMP_NUM_THREADS"] == "12" and "--num_cpu_threads_per_process" not in gpu.command
    assert "per GPU" in gpu.banner


def test_a_process_pinned_to_one_core_launches_one_thread(tmp_path):
    """Slurm's cpus-per-task, taskset and container cpusets limit the cores a run may use: its thread share is
    taken from them, not from the machine's count (2 threads on 1 core thrash)."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "memrecipe", "run", "sft", "--recipe", "single-gpu-lora",
                           "--dry-run", "--output-dir", str(tmp_path / "run")], capture_output=True, text=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, {0}), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--num_cpu_threads_per_process 1 " in done.stdout + done.stderr


def test_a_dry_run_names_what_a_run_would_be_refused_for(tmp_path):
    folder = model_folder(tmp_path / "llama-70b", LLAMA_70B)
    plan = plan_run("sft", "fsdp", [f"model_name_or_path={folder}", "fsdp.cpu_ram_efficient_loading=false"],
                    tmp_path / "run", {"num_processes": 8},
                    dry_run=True, machine=Machine(8, 80 * GiB, True, 96, 512 * GiB))
    assert any("recipe fsdp will not fit" in line and "host RAM" in line for line in plan.refused)
    assert plan.command and not plan.folder.exists()  # the launch line is still shown; nothing is written


@pytest.mark.parametrize("script, recipe, resume, message", [
    ("grpo", "fsdp", False, "unknown script 'grpo'"),
    ("sft", None, False, "name a recipe with --recipe"),
    ("sft", None, True, "--resume needs the run folder"),
])
def test_what_cannot_be_planned_is_refused_in_one_line(script, recipe, resume, message):
    with pytest.raises(RecipeError, match=message):
        plan_run(script, recipe, [], None, CPU2, resume=resume, machine=LAPTOP)


def recipe_path(script: str, recipe: str, machine: Machine, topology: dict, folder: Path) -> list[str]:
    """The functions a run's recipe is handed to on its way from `memrecipe run` to the launch line, in call order,
    as module.function: every call of a memrecipe function that takes the Recipe as an argument (asking the recipe
    itself, recipe.script or recipe.to_yaml, is not handing it on)."""
    import sys

    from memrecipe.planning.recipe import Recipe

    path = []

    def watch(frame, event, arg):
        code = frame.f_code
        if event != "call" or not frame.f_globals.get("__name__", "").startswith("memrecipe."):
            return
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if any(isinstance(frame.f_locals.get(name), Recipe) for name in names if name != "self"):
            path.append(f"{frame.f_globals['__name__'].removeprefix('memrecipe.')}.{code.co_name}")

    sys.setprofile(watch)
    try:
        plan_run(script, recipe, [], folder, topology, machine=machine)
    finally:
        sys.setprofile(None)
    return path


def reentries(path: list[str]) -> list[str]:
    """The stops where the path climbs back into a module it had already left."""
    seen, before, back = set(), None, []
    for stop in path:
        module = stop.rpartition(".")[0]
        if module != before and module in seen:
            back.append(stop)
        seen.add(module)
        before = module
    return back


@pytest.mark.parametrize("script, recipe, machine, topology", [
    ("sft", "single-gpu-lora", LAPTOP, {"cpu": True}),
    ("sft", "fsdp", LAPTOP, CPU2),
    ("sft", "zero3-offload", LAPTOP, CPU2),
    ("sft", "tp", NODE, {"num_processes": 8}),
    ("dpo", "qlora", NODE, {"num_processes": 1}),
    ("dpo", "fsdp-lora", NODE, {"num_processes": 8}),
])
def test_a_run_visits_each_module_on_its_way_to_the_launch_for_one_reason(script, recipe, machine, topology,
                                                                            tmp_path):
    """Issue 24's structure measure: following the recipe from the run command to the launch line re-enters a
    module it already left at most 8 times (this walk counted 11 before the loop script became Recipe.script)."""
    path = recipe_path(script, recipe, machine, topology, tmp_path / "run")
    modules = {stop.rpartition(".")[0] for stop in path}
    assert {"planning.rules", "planning.planner", "planning.configs", "launching.launch"} <= modules, path
    again = reentries(path)
    assert len(again) <= 8, "\n".join(f"{stop}{'  <- again' if stop in again else ''}" for stop in path)


def test_a_run_decides_its_precision_once_and_every_file_reads_that_decision(tmp_path):
    """`mixed_precision: auto` is worked out once, where the run's plan starts (topology.plan_topology), and the
    configs, the estimate and the run folder's recipe read the decided recipe: a V100 (no bf16) plans fp16 in all."""
    import sys

    from memrecipe.planning import topology

    decided = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code is topology.resolve_precision.__code__:
            decided.append(frame.f_locals["recipe"].mixed_precision)

    volta = Machine(gpus=8, gpu_memory=32 * GiB, bf16=False, cores=96, host_memory=1024 * GiB)
    sys.setprofile(watch)
    try:
        plan = plan_run("sft", "fsdp-lora", [], tmp_path / "run", {"num_processes": 8}, dry_run=True, machine=volta)
    finally:
        sys.setprofile(None)
    assert decided.count("auto") == 1, decided
    assert yaml.safe_load(plan.files["recipe.yaml"])["mixed_precision"] == "fp16"
    assert yaml.safe_load(plan.files["accelerate_config.yaml"])["mixed_precision"] == "fp16"
    assert plan.recipe.mixed_precision == "fp16"


def test_a_run_takes_peft_s_dropout_where_it_fits_and_its_recipe_yaml_says_so(tmp_path):
    """`lora.redraw_dropout: auto` is decided by the plan of the machine the run launches on (planner.decide_dropout)
    and the answer is written into the run folder's recipe.yaml, which the loop and a resume read: peft's dropout
    at 2K tokens of an 8B on an 80 GB GPU, the redraw at 700K (where only it fits), said before the launch."""
    folder = model_folder(tmp_path / "llama-8b", LLAMA_8B)
    h100 = Machine(gpus=1, gpu_memory=80 * 10**9, bf16=True, cores=16, host_memory=2048 * GiB)
    top = [f"model_name_or_path={folder}", "per_device_train_batch_size=1", "gradient_checkpointing=true",
           "activation_offload=true", "lean_norms=true", "tiled_mlp=true", "attn_implementation=flex_attention"]
    for length, redraw in ((2048, False), (700 * 1024, True)):
        plan = plan_run("sft", "single-gpu-lora", [*top, f"max_seq_length={length}"], tmp_path / f"run-{length}",
                        {"num_processes": 1}, dry_run=True, machine=h100)
        assert plan.verdict.fits and not plan.refused, plan.refused
        assert plan.recipe.lora.redraw_dropout is redraw and plan.verdict.estimate.redraws_dropout is redraw
        assert yaml.safe_load(plan.files["recipe.yaml"])["lora"]["redraw_dropout"] is redraw
        assert any(note.startswith("lora.redraw_dropout: auto redraws") for note in plan.notes) is redraw
