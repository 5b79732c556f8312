import sys
from pathlib import Path

import click

from ..errors import RecipeError, did_you_mean
from ..files import write_files
from ..hardware import Machine
from ..launcher import (SCRIPTS, absolute_paths, default_output_dir, launch_command, launch_env,
                        plan_topology, prepare_folder, run_files, shell_form, stream)
from ..options import overrides_argument, topology_options
from ..registry import load_recipe


@click.command("run")
@click.argument("script")
@click.option("--recipe", required=True, help="Recipe name (memrecipe ls) or YAML file.")
@click.option("--model", default=None, help="Hub id or local folder (default: the recipe's, or the embedded tiny model).")
@click.option("--dataset", default=None, help="Hub id or .jsonl/.json/.parquet/.csv file (default: the embedded one).")
@click.option("--output-dir", type=click.Path(path_type=Path), default=None,
              help="Run folder (default: runs/<recipe>-<time>).")
@topology_options
@click.option("--report-to", type=click.Choice(["none", "tensorboard", "wandb"]), default=None,
              help="Tracker for the loss curves.")
@click.option("--overwrite", is_flag=True, help="Replace the run in a non-empty --output-dir.")
@click.option("--dry-run", is_flag=True, help="Print the command and the files; write and run nothing.")
@click.option("--force", is_flag=True, help="Launch even if the planner says it will not fit.")
@click.option("--memory-snapshot", is_flag=True,
              help="Record memory over the first steps: CUDA allocator history, or the CPU profiler's timeline.")
@overrides_argument
def command(script, recipe, model, dataset, output_dir, num_processes, num_machines, machine_rank, main_process_ip,
            main_process_port, cpu, report_to, overwrite, dry_run, force, memory_snapshot, overrides):
    """Train with a recipe, checked and launched with accelerate.

    \b
    memrecipe run sft --recipe single-gpu-lora               # the embedded tiny model and data
    memrecipe run sft --recipe fsdp --num-processes 8 --model meta-llama/Llama-3.1-8B --dataset data.jsonl
    memrecipe run sft --recipe zero3-offload max_steps=100 --dry-run
    """
    if script not in SCRIPTS:
        raise RecipeError(f"unknown script {script!r}{did_you_mean(script, SCRIPTS)}; scripts: {', '.join(SCRIPTS)}")
    flags = [f"{key}={value}" for key, value in
             (("model_name_or_path", model), ("dataset", dataset), ("report_to", report_to)) if value is not None]
    r = absolute_paths(load_recipe(recipe, [*overrides, *flags]))
    machine = Machine.detect()
    topo = plan_topology(r, machine, num_processes, num_machines, machine_rank, main_process_ip, main_process_port, cpu)
    if not dry_run:
        preflight(r)
    verdict = check_fits(r, topo, machine, [*overrides, *flags], force)
    folder = output_dir or default_output_dir(r)
    files = run_files(r, topo)
    command_words = launch_command(script, topo, machine.cores, ["--memory-snapshot"] if memory_snapshot else [])
    env = launch_env(r, topo)
    mode = "CPU smoke-test mode: no GPU, gloo" if topo.cpu else f"{topo.describe()}"
    need = verdict.estimate.host_total() if topo.cpu else verdict.estimate.total
    banner = (f"memrecipe: {r.name} on {topo.describe()} ({mode}), planned {need / 2**30:.1f} GiB "
              f"{'of host RAM' if topo.cpu else 'per GPU'} -> {folder}")
    if dry_run:
        click.echo(banner, err=True)
        click.echo(shell_form(command_words, env, folder))
        for name, text in files.items():
            click.echo(f"\n==> {folder / name} <==")
            click.echo(text, nl=False)
        return
    prepare_folder(folder, overwrite)
    click.echo(banner, err=True)
    write_files(folder, files, force=True)
    sys.exit(stream(command_words, folder, env, folder / "train.log"))


def preflight(recipe):
    """Fail fast, with one line and before any folder exists: model, tokenizer, dataset columns."""
    from ..data import detect_format, load_any
    from ..modeling import check_model

    if recipe.model_name_or_path:
        check_model(recipe.model_name_or_path, recipe.trust_remote_code)
    for source in (recipe.dataset, recipe.eval_dataset):
        if source:
            detect_format(load_any(source).column_names, recipe.dataset_format)


def check_fits(recipe, topo, machine, words, force):
    """The planner's verdict; a run that will not fit is refused with its breakdown and what would fit."""
    from ..architecture import read_config, structure
    from ..planner import breakdown, estimate, judge
    from ..registry import recipe_names
    from ..topology import check_supported

    shape = structure(read_config(recipe.model_name_or_path))
    verdict = judge(estimate(recipe, shape, topo), machine.gpu_memory, machine.host_memory or None)
    if verdict.fits or force:
        return verdict
    others = []
    for name in recipe_names():
        if name == recipe.name:
            continue
        try:
            other = load_recipe(name, words)
            check_supported(other, topo)
        except RecipeError:
            continue
        v = judge(estimate(other, shape, topo), machine.gpu_memory, machine.host_memory or None)
        if v.fits:
            others.append((v.estimate.speed_cost, name, v.estimate.total))
    est = verdict.estimate
    where = (f"host RAM {est.host_total() / 2**30:.1f} GiB > {machine.host_memory / 2**30:.1f} GiB"
             if not verdict.host_fits else f"{est.total / 2**30:.1f} GiB per GPU > {machine.gpu_memory / 2**30:.1f} GiB")
    instead = (f"{min(others)[1]} would fit ({min(others)[2] / 2**30:.1f} GiB per process)" if others
               else "no recipe fits on this topology: more GPUs, a shorter max_seq_length, or a smaller micro batch")
    raise RecipeError(f"recipe {recipe.name} will not fit: {where} ({breakdown(est)}); {instead}; "
                      "--force launches anyway")
