import signal
import sys
from pathlib import Path

import click

from ..launching.launch import shell_form
from ..launching.run_folder import RunFolder
from ..launching.runner import discard_failed_start, plan_run, start
from ..layout import complete_checkpoints
from ..options import dataset_option, model_option, overrides_argument, topology_options
from ..planning.registry import flag_overrides


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
@click.option("--profile", is_flag=True,
              help="Record where the second step's time goes: torch's profiler, a GPU's kernels too (profile_rank*.txt).")
@overrides_argument
def command(script, recipe, model, dataset, output_dir, num_processes, num_machines, machine_rank, main_process_ip,
            main_process_port, cpu, report_to, resume, overwrite, dry_run, force, memory_snapshot, profile, overrides):
    """Train with a recipe, checked and launched with accelerate: SCRIPT is sft (supervised fine-tuning) or dpo
    (preference pairs).

    \b
    memrecipe run sft --recipe single-gpu-lora               # the embedded tiny model and data
    memrecipe run dpo --recipe single-gpu-lora               # ... and the embedded preference pairs
    memrecipe run sft --recipe fsdp --num-processes 8 --model meta-llama/Llama-3.1-8B --dataset data.jsonl
    memrecipe run sft --recipe zero3-offload max_steps=100 --dry-run
    memrecipe run sft --resume --output-dir runs/fsdp-20261122-010000 max_steps=2000
    """
    words = [*overrides, *flag_overrides(model=model, dataset=dataset, report_to=report_to)]
    topology_flags = {"num_processes": num_processes, "num_machines": num_machines, "machine_rank": machine_rank,
                "main_process_ip": main_process_ip, "main_process_port": main_process_port, "cpu": cpu}
    plan = plan_run(script, recipe, words, output_dir, topology_flags, resume, force, memory_snapshot, dry_run,
                    profile=profile)
    if dry_run:  # what `run` would do here, step by step; nothing is written
        click.echo(plan.banner, err=True)
        for why in plan.refused:
            click.echo(f"memrecipe: a run on this machine would be refused: {why}", err=True)
        for note in plan.notes:
            click.echo(f"memrecipe: note: {note}", err=True)
        made = "" if plan.folder.is_dir() else "create it, "
        click.echo(f"# memrecipe run would {made}write the {len(plan.files)} file(s) shown below into {plan.folder}, "
                   "then run:")
        click.echo(shell_form(plan.command, plan.env, plan.folder))
        for name, text in plan.files.items():
            click.echo(f"\n==> {plan.folder / name} <==")
            click.echo(text, nl=False)
        return
    report = RunFolder(plan.folder).report
    before = _stamp(report)  # (a resumed run's folder already holds the last stop's report)
    outcome = start(plan, overwrite, say=lambda line: click.echo(line, err=True))
    if outcome.status and not outcome.stopped_by and output_dir is None:
        discard_failed_start(plan)  # a timestamped folder holding only a failed start
    if outcome.error and not outcome.stopped_by:  # the loop said what is wrong, in its one line
        sys.exit(2)  # (the folder stays reusable by the same command)
    if outcome.stopped_by:
        name = signal.Signals(outcome.stopped_by).name
        if _stamp(report) not in (None, before):  # the run wrote its report: the signal came after the last step
            click.echo(f"memrecipe: {name} came after the run had finished: final/ and report.json are in "
                       f"{plan.folder}", err=True)
            sys.exit(outcome.status)
        if not complete_checkpoints(plan.folder):  # stopped before its first checkpoint was whole
            click.echo(f"memrecipe: stopped by {name} before any checkpoint was complete: nothing to resume "
                       f"({plan.folder} keeps its log; --overwrite starts the run there again)", err=True)
        else:
            click.echo(f"memrecipe: stopped by {name}; resume with: "
                       f"memrecipe run {script} --resume --output-dir {plan.folder}", err=True)
        sys.exit(128 + outcome.stopped_by)
    sys.exit(outcome.status)


def _stamp(path):
    """A file's (mtime, size, inode), or None. Compared before and after, never ordered against time.time(): that
    clock runs ahead of the coarse one file systems stamp with, so a report written just after the start could
    look older than the start."""
    try:
        stat = path.stat()
    except OSError:  # none yet (or the folder is a file: the launch refused it)
        return None
    return stat.st_mtime_ns, stat.st_size, stat.st_ino
