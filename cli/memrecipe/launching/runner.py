"""A run from start to end, as `memrecipe run` does it: checked and laid out (`plan_run`: the recipe,
the topology, preflight, the fit, the folder's files, the launch command), then started (`start`: the
folder made or reused under its lock, the files written, the launch streamed). The click command only
parses options and prints; everything here is callable from Python."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import RecipeError, did_you_mean
from ..files import write_files
from ..planning.hardware import Machine
from ..planning.paths import absolute_paths, check_paths
from ..planning.planner import Verdict
from ..planning.recipe import Recipe
from ..planning.architecture import read_config
from ..planning.positions import positions_note
from ..planning.registry import load_recipe, method_rate_note
from ..planning.topology import Topology, decide, plan_topology
from ..units import GiB
from .checks import check_fits, deepspeed_builds, preflight, resumable
from .launch import SCRIPTS, launch, stream
from .run_folder import RunFolder, default_run_folder, run_files


@dataclass(frozen=True)
class RunPlan:
    """A run checked and laid out, not started: what --dry-run shows and `start` does."""
    recipe: Recipe
    topo: Topology
    verdict: Verdict
    folder: Path
    files: dict[str, str]  # file name in the folder -> text
    command: list[str]  # run inside the folder
    env: dict[str, str]  # on top of the user's environment
    resume: bool
    refused: tuple[str, ...] = ()  # a dry run's: what a run here would be refused for (this machine, the fit)
    notes: tuple[str, ...] = ()  # what the user should know before the launch (a first-use compile)

    @property
    def banner(self) -> str:
        topo, est = self.topo, self.verdict.estimate
        mode = "CPU smoke-test mode: no GPU, gloo" if topo.cpu else topo.describe()
        need = est.host_total() if topo.cpu else est.total
        return (f"memrecipe: {self.recipe.name} on {topo.describe()} ({mode}), planned {need / GiB:.1f} GiB "
                f"{'of host RAM' if topo.cpu else 'per GPU'} -> {self.folder}")


@dataclass(frozen=True)
class Outcome:
    status: int  # the launch's exit status
    stopped_by: int  # the signal that asked the run to stop, or 0
    error: str | None  # the loop's one-line error, if it reported one


def plan_run(script: str, recipe_ref: str | None, words: list[str], output_dir: Path | None, topology_flags: dict,
             resume=False, force=False, memory_snapshot=False, dry_run=False, machine: Machine | None = None,
             profile=False) -> RunPlan:
    """Everything `memrecipe run` checks before it touches the disk. `words` are the KEY=VALUE overrides
    (the --model/--dataset/--report-to flags among them); `topology_flags` the topology flags (num_processes,
    num_machines, machine_rank, main_process_ip, main_process_port, cpu). A real run loads the model's config,
    the tokenizer and the datasets first (preflight), a dry run too; what this machine or the fit would refuse
    becomes a dry run's `refused` lines (a GPU launch line can be previewed on a laptop)."""
    if script not in SCRIPTS:
        raise RecipeError(f"unknown script {script!r}{did_you_mean(script, SCRIPTS)}; scripts: {', '.join(SCRIPTS)}")
    if machine is None:
        from ..training.device import detect_machine  # torch: what the launch will see

        machine = detect_machine()
    refused: list[str] = []
    unchecked: list[str] = []  # what a dry run could not check (a model folder without its weights yet)
    if resume:
        r, topo = resumable(output_dir, recipe_ref, words, topology_flags.get("num_processes"), machine,
                            topology_flags.get("machine_rank", 0))
        r = decide(r, topo)
        if r.script != script:  # the folder's recipe says which loop trained it
            raise RecipeError(f"{output_dir} is a run of {r.script}: continue it with memrecipe run {r.script} "
                              f"--resume --output-dir {output_dir}")
    else:
        if recipe_ref is None:
            raise RecipeError("name a recipe with --recipe (memrecipe ls lists them), or --resume a run")
        r = absolute_paths(load_recipe(recipe_ref, words, script))
        check_paths(r, weights=not dry_run)  # also in a dry run: a missing file is known without reading anything
        r, topo = plan_topology(r, machine, **topology_flags, refused=refused if dry_run else None)
        unchecked = preflight(r, dry_run)  # the model, the tokenizer and the data, read as the run reads them
    try:
        notes = deepspeed_builds(r, topo)  # (beside the other checks: what compiles before the first step)
    except RecipeError as e:
        if not dry_run:
            raise
        refused.append(str(e))
        notes = []
    notes += unchecked
    if not resume:  # (said when the run started; a resumed folder's paths are its own, relative to it)
        notes += [note for note in [method_rate_note(str(recipe_ref), words),
                                    positions_note(r, read_config(r.model_name_or_path))] if note]
    try:
        r, verdict = check_fits(r, topo, machine, words, force)
    except RecipeError as e:
        if not dry_run:
            raise
        refused.append(str(e))
        r, verdict = check_fits(r, topo, machine, words, force=True)
    notes += [note for note in verdict.estimate.notes if note.startswith("lora.redraw_dropout:")]  # what auto took
    folder = Path(output_dir or default_run_folder(r.name))
    files = run_files(r, topo)
    if resume:  # the folder's own launch configs stay; only the recipe may have raised max_steps
        files = {name: text for name, text in files.items() if name.startswith("recipe.")}
    extra = [flag for flag, on in (("--resume", resume), ("--memory-snapshot", memory_snapshot),
                                   ("--profile", profile)) if on]
    command, env = launch(script, r, topo, machine.cores, extra)
    return RunPlan(r, topo, verdict, folder, files, command, env, resume, tuple(refused), tuple(notes))


def start(plan: RunPlan, overwrite=False, say=print) -> Outcome:
    """Make or reuse the folder under its lock, write the plan's files, launch and stream. Machine rank 0
    owns the folder (clears it with `overwrite`, or reuses a start that failed); the other machines of a
    run add their own launch files to it. `say` gets the lines for the user (the banner first)."""
    folder, run = plan.folder, RunFolder(plan.folder, plan.topo.machine_rank)
    owner = not plan.resume and plan.topo.machine_rank == 0
    reuse = owner and run.failed_start()  # an earlier start that failed before any checkpoint: the same command may
    if owner and folder.is_dir() and run.owned() and not overwrite and not reuse:
        run.clear(overwrite=False)  # refuses, before anything is touched
    run.make()
    lock = run.lock().acquire()  # before clearing: a running run's folder is never emptied
    try:
        if owner:
            run.clear(overwrite or reuse)
        if lock.taken_over:
            say(f"memrecipe: {folder}/.lock belonged to process {lock.taken_over}, which is gone: taken over")
        say(plan.banner)
        for note in plan.notes:
            say(f"memrecipe: note: {note}")
        write_files(folder, plan.files, force=True)
        return Outcome(*stream(plan.command, folder, plan.env, run.train_log))
    finally:
        lock.release()


def discard_failed_start(plan: RunPlan) -> None:
    """Remove the folder of a start that failed (nothing in it but the launch files and the log) when memrecipe
    named it, runs/<recipe>-<time>: each retry would leave one more. A folder the user named stays, for the same
    command to use again."""
    import shutil

    if not plan.resume and RunFolder(plan.folder).failed_start():
        shutil.rmtree(plan.folder, ignore_errors=True)
