import signal
import sys
from pathlib import Path

import click

from ..errors import RecipeError, did_you_mean
from ..files import write_files
from ..hardware import Machine
from ..launcher import (SCRIPTS, absolute_paths, check_fits, launch_command, launch_env, plan_topology, preflight,
                        resumable, run_files, shell_form, stream)
from ..run_folder import RunFolder, default_run_folder
from ..options import dataset_option, model_option, overrides_argument, topology_options
from ..registry import load_recipe
from ..units import GiB


@click.command("run")
@click.argument("script")
@click.option("--recipe", default=None, help="Recipe name (memrecipe ls) or YAML file.")
@model_option
@dataset_option
@click.option("--output-dir", type=click.Path(path_type=Path), default=None,
              help="Run folder (default: runs/<recipe>-<time>).")
@topology_options
@click.option("--report-to", type=click.Choice(["none", "tensorboard", "wandb"]), default=None,
              help="Tracker for the loss curves.")
@click.option("--resume", is_flag=True, help="Continue the run in --output-dir from its newest checkpoint.")
@click.option("--overwrite", is_flag=True, help="Replace the run in a non-empty --output-dir.")
@click.option("--dry-run", is_flag=True, help="Print the command and the files; write and run nothing.")
@click.option("--force", is_flag=True, help="Launch even if the planner says it will not fit.")
@click.option("--memory-snapshot", is_flag=True,
              help="Record memory over the first steps: CUDA allocator history, or the CPU profiler's timeline.")
@overrides_argument
def command(script, recipe, model, dataset, output_dir, num_processes, num_machines, machine_rank, main_process_ip,
            main_process_port, cpu, report_to, resume, overwrite, dry_run, force, memory_snapshot, overrides):
    """Train with a recipe, checked and launched with accelerate.

    \b
    memrecipe run sft --recipe single-gpu-lora               # the embedded tiny model and data
    memrecipe run sft --recipe fsdp --num-processes 8 --model meta-llama/Llama-3.1-8B --dataset data.jsonl
    memrecipe run sft --recipe zero3-offload max_steps=100 --dry-run
    memrecipe run sft --resume --output-dir runs/fsdp-20261122-010000 max_steps=2000
    """
    if script not in SCRIPTS:
        raise RecipeError(f"unknown script {script!r}{did_you_mean(script, SCRIPTS)}; scripts: {', '.join(SCRIPTS)}")
    flags = [f"{key}={value}" for key, value in
             (("model_name_or_path", model), ("dataset", dataset), ("report_to", report_to)) if value is not None]
    machine = Machine.detect()
    if resume:
        r, topo = resumable(output_dir, recipe, [*overrides, *flags], num_processes, machine, machine_rank)
    else:
        if recipe is None:
            raise RecipeError("name a recipe with --recipe (memrecipe ls lists them), or --resume a run")
        r = absolute_paths(load_recipe(recipe, [*overrides, *flags]))
        topo = plan_topology(r, machine, num_processes, num_machines, machine_rank, main_process_ip,
                             main_process_port, cpu)
        if not dry_run:
            preflight(r)
    verdict = check_fits(r, topo, machine, [*overrides, *flags], force)
    folder = output_dir or default_run_folder(r.name)
    run = RunFolder(folder, topo.machine_rank)
    files = run_files(r, topo)
    if resume:  # the folder's own launch configs stay; only the recipe may have raised max_steps
        files = {name: text for name, text in files.items() if name.startswith("recipe.")}
    extra = [flag for flag, on in (("--resume", resume), ("--memory-snapshot", memory_snapshot)) if on]
    command_words = launch_command(script, topo, machine.cores, extra)
    env = launch_env(r, topo, machine.cores)
    mode = "CPU smoke-test mode: no GPU, gloo" if topo.cpu else f"{topo.describe()}"
    need = verdict.estimate.host_total() if topo.cpu else verdict.estimate.total
    banner = (f"memrecipe: {r.name} on {topo.describe()} ({mode}), planned {need / GiB:.1f} GiB "
              f"{'of host RAM' if topo.cpu else 'per GPU'} -> {folder}")
    if dry_run:  # what `run` would do here, step by step; nothing is written
        click.echo(banner, err=True)
        made = "" if folder.is_dir() else "create it, "
        click.echo(f"# memrecipe run would {made}write the {len(files)} file(s) shown below into {folder}, then run:")
        click.echo(shell_form(command_words, env, folder))
        for name, text in files.items():
            click.echo(f"\n==> {folder / name} <==")
            click.echo(text, nl=False)
        return
    # Machine rank 0 owns the folder; the other machines of a run add their own launch config to it.
    owner = not resume and topo.machine_rank == 0
    reuse = owner and run.failed_start()  # an earlier start that failed before any checkpoint: the same command may
    if owner and folder.is_dir() and run.owned() and not overwrite and not reuse:
        run.clear(overwrite=False)  # refuses, before anything is touched
    run.make()
    lock = run.lock().acquire()  # before clearing: a running run's folder is never emptied
    try:
        if owner:
            run.clear(overwrite or reuse)
        if lock.taken_over:
            click.echo(f"memrecipe: {folder}/.lock belonged to process {lock.taken_over}, which is gone: taken over",
                       err=True)
        click.echo(banner, err=True)
        write_files(folder, files, force=True)
        status, stopped_by, error = stream(command_words, folder, env, run.train_log)
    finally:
        lock.release()
    if error and not stopped_by:  # the loop said what is wrong, in its one line: the folder stays reusable
        sys.exit(2)
    if stopped_by:
        click.echo(f"memrecipe: stopped by {signal.Signals(stopped_by).name}; resume with: "
                   f"memrecipe run {script} --resume --output-dir {folder}", err=True)
        sys.exit(128 + stopped_by)
    sys.exit(status)
