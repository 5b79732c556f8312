"""The launcher: check the run, lay out the run folder, start `accelerate launch`, stream its output.

The only module besides the loop that touches processes and disk.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from .errors import RecipeError
from .hardware import Machine
from .generator import accelerate_config, deepspeed_config, render_json, render_yaml
from .recipe import Recipe
from .registry import data_dir
from .topology import Topology, check_supported, make_topology

SCRIPTS = ("sft",)
RUN_FILES = ("recipe.yaml", "accelerate_config.yaml", "deepspeed_config.json")


def plan_topology(recipe: Recipe, machine: Machine, num_processes=None, num_machines=1, machine_rank=0,
                  main_process_ip=None, main_process_port=None, cpu=False) -> Topology:
    """The topology for this run: the flags, else every GPU (as many as the recipe takes), else
    the CPU smoke-test form (1 process, or 2 for recipes that shard)."""
    cpu = cpu or machine.gpus == 0
    s = recipe.supports
    if num_processes is None:
        if cpu:
            num_processes = 1 if s.max_processes == 1 and s.min_processes == 1 else max(2, s.min_processes)
        else:
            num_processes = min(machine.gpus, s.max_processes or machine.gpus) * num_machines
    topo = make_topology(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, cpu,
                         None if cpu else machine.bf16)
    check_supported(recipe, topo)
    local = topo.processes_per_machine
    if not cpu and local > machine.gpus:
        raise RecipeError(f"{local} processes per machine need {local} GPUs; this machine has {machine.gpus}: "
                          f"lower --num-processes")
    if cpu and local > machine.cores:
        raise RecipeError(f"{local} CPU processes need {local} cores; this machine has {machine.cores}")
    return topo


def absolute_paths(recipe: Recipe) -> Recipe:
    """Local model/dataset paths made absolute: the run starts inside its own folder."""
    def fix(value):
        if value and Path(value).expanduser().exists():
            return str(Path(value).expanduser().resolve())
        return value

    return replace(recipe, model_name_or_path=fix(recipe.model_name_or_path), dataset=fix(recipe.dataset),
                   eval_dataset=fix(recipe.eval_dataset))


def run_files(recipe: Recipe, topo: Topology) -> dict[str, str]:
    """The run folder's resolved recipe and launch configs; paths inside are relative to the folder."""
    files = {"recipe.yaml": f"# Resolved recipe of this run: the single source of truth for it.\n{recipe.to_yaml()}"}
    ds = deepspeed_config(recipe, topo)
    header = [f"memrecipe run of recipe {recipe.name} on {topo.describe()}."]
    files["accelerate_config.yaml"] = render_yaml(
        accelerate_config(recipe, topo, "deepspeed_config.json" if ds else None), header)
    if ds is not None:
        files["deepspeed_config.json"] = render_json(ds, f"memrecipe run of recipe {recipe.name} on {topo.describe()}")
    return files


def launch_env(recipe: Recipe, topo: Topology) -> dict[str, str]:
    """Environment the launch needs on top of the user's."""
    env = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    if topo.cpu:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed would guess the CPU anyway, with a warning
        if recipe.deepspeed is None and topo.num_processes > 1:
            # accelerate starts one process for MULTI_CPU; GPU types with this flag start N on gloo
            env["ACCELERATE_USE_CPU"] = "true"
    return env


def launch_command(script: str, topo: Topology, cores: int, extra=()) -> list[str]:
    """`accelerate launch` run from inside the run folder."""
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    words = [accelerate, "launch"] if accelerate else [sys.executable, "-m", "accelerate.commands.launch"]
    words += ["--config_file", "accelerate_config.yaml"]
    if topo.cpu:  # share the cores out (accelerate warns and guesses otherwise)
        words += ["--num_cpu_threads_per_process", str(max(1, cores // topo.processes_per_machine))]
    sft = data_dir("recipes") / f"{script}.py"
    return [*words, str(sft), "--recipe", "recipe.yaml", "--output-dir", ".", *extra]


def default_output_dir(recipe: Recipe) -> Path:
    """runs/<recipe>-<YYYYmmdd-HHMMSS>, with -2, -3... if runs start within the same second."""
    base = Path("runs") / f"{recipe.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    return folder


def prepare_folder(folder: Path, overwrite: bool) -> None:
    """Refuse a non-empty folder (unless overwrite); remove the old run's outputs when overwriting."""
    if folder.exists() and not folder.is_dir():
        raise RecipeError(f"--output-dir {folder} is a file: pick a folder")
    if folder.is_dir() and any(folder.iterdir()):
        if not overwrite:
            raise RecipeError(f"{folder} is not empty: pass --overwrite to replace its run, or pick another --output-dir")
        for child in folder.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RecipeError(f"cannot create {folder}: {e.strerror}: pick another --output-dir") from None


def stream(command: list[str], cwd: Path, env: dict, log: Path) -> int:
    """Run the launch; its output goes to the terminal and to train.log (progress-bar redraws left out)."""
    with open(log, "w", encoding="utf-8") as sink:
        proc = subprocess.Popen(command, cwd=cwd, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        try:
            pending = b""
            while chunk := proc.stdout.read1(65536):
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    sink.write(line.rsplit(b"\r", 1)[-1].decode("utf-8", "replace") + "\n")
                sink.flush()
            if pending:
                sink.write(pending.rsplit(b"\r", 1)[-1].decode("utf-8", "replace") + "\n")
            return proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            return proc.wait()


def shell_form(command: list[str], env: dict, cwd: Path) -> str:
    words = [f"{k}={shlex.quote(v)}" for k, v in env.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"]
    return f"cd {shlex.quote(str(cwd))} && " + " ".join(words + [shlex.join(command)])

