"""The run folder: its default name, the files written into it, its lock, and what it holds (nothing yet, a start
that failed, a resumable run, a finished one). The names of its files are the layout's (memrecipe/layout.py)."""

from __future__ import annotations

import os
import shutil
import socket
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import RecipeError
from ..files import make_folder
from ..layout import (CHECKPOINTS, DEEPSPEED_CONFIG, FINAL, INITIAL_ADAPTER, LAUNCH_CONFIG, LOSS_PLOT, MEMORY_RECORDS,
                      PROBE, RECIPE, REPORT, STARTED, TRAIN_LOG, machine_file)
from ..planning.configs import Invocation, accelerate_config, deepspeed_config, render_json, render_yaml
from ..planning.registry import data_dir

if TYPE_CHECKING:
    from ..planning.recipe import Recipe
    from ..planning.topology import Topology

# in a launch's environment: started by `memrecipe run` (the loop's resume hint says so)
LAUNCHED_BY = "MEMRECIPE_RUN"


def run_files(recipe: Recipe, topo: Topology) -> dict[str, str]:
    """The run folder's resolved recipe and launch configs (this machine's); paths inside are
    relative to the folder."""
    name = lambda n: machine_file(n, topo.machine_rank)  # noqa: E731
    files = {name(RECIPE): f"# Resolved recipe of this run: the single source of truth for it.\n{recipe.to_yaml()}"}
    ds = deepspeed_config(recipe, topo)
    script = str(data_dir("recipes") / f"{recipe.script}.py")  # this installation's loop (`memrecipe cp`: a copy)
    run = Invocation.of(recipe, topo, name(LAUNCH_CONFIG), script, name(RECIPE))
    header = [f"memrecipe run of recipe {recipe.name} on {topo.describe()}.",
              f"Continue it: memrecipe run {recipe.script} --resume --output-dir THIS_FOLDER",
              f"Run:        (in this folder) {run.shell()} --resume --output-dir ."]
    files[name(LAUNCH_CONFIG)] = render_yaml(accelerate_config(recipe, topo, name(DEEPSPEED_CONFIG) if ds else None),
                                             header)
    if ds is not None:
        files[name(DEEPSPEED_CONFIG)] = render_json(ds, f"memrecipe run of recipe {recipe.name} on {topo.describe()}")
    return files


def run_folder_name(recipe_name: str, stamp: str | None = None) -> str:
    """runs/<recipe>-<stamp>: the time the run starts (YYYYmmdd-HHMMSS), or a stamp of the caller's (the sbatch
    script's job id)."""
    return f"runs/{recipe_name}-{stamp or datetime.now().strftime('%Y%m%d-%H%M%S')}"


def default_run_folder(recipe_name: str) -> Path:
    """runs/<recipe>-<YYYYmmdd-HHMMSS>, with -2, -3... if runs start within the same second."""
    base = Path(run_folder_name(recipe_name))
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    return folder


class RunFolder:
    """One run's folder, as machine `machine_rank` of the run sees it."""

    def __init__(self, path, machine_rank: int = 0, script: str = "sft"):
        self.path, self.machine_rank, self.script = Path(path), machine_rank, script  # script: the loop that trains it

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def file(self, name: str) -> Path:
        """One of the per-machine launch files (recipe, launch config, log) of this machine."""
        return self.path / machine_file(name, self.machine_rank)

    @property
    def recipe(self) -> Path:
        return self.file(RECIPE)

    @property
    def launch_config(self) -> Path:
        return self.file(LAUNCH_CONFIG)

    @property
    def train_log(self) -> Path:
        return self.file(TRAIN_LOG)

    @property
    def final(self) -> Path:
        return self.path / FINAL

    @property
    def report(self) -> Path:
        return self.path / REPORT

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def initial_adapter(self) -> Path:
        return self.path / INITIAL_ADAPTER

    @property
    def loss_plot(self) -> Path:
        return self.path / LOSS_PLOT

    def resume_hint(self) -> str:
        """The command that continues this run (either works: the folder holds both the recipe and the config)."""
        how = (f"memrecipe run {self.script} --resume --output-dir" if os.environ.get(LAUNCHED_BY) else
               "your accelerate launch command with --resume --output-dir")
        return f"{how} {self.path.resolve()}"

    def owned(self) -> list[Path]:
        """What machine rank 0's run owns in the folder (not the locks, not the other machines' files)."""
        return [c for c in self.path.iterdir()
                if not c.name.startswith((".lock", PROBE)) and ".machine" not in c.name]

    def failed_start(self) -> bool:
        names = {c.name for c in self.owned()} if self.path.is_dir() else set()
        return bool(names) and all(n in STARTED or n.startswith(MEMORY_RECORDS) for n in names)

    def make(self) -> None:
        make_folder(self.path, "pick another --output-dir")

    def clear(self, overwrite: bool) -> None:
        """Under our lock: refuse a non-empty folder, or (overwrite) remove the old run's files."""
        old = self.owned()
        if old and not overwrite:
            raise RecipeError(f"{self.path} is not empty: pass --overwrite to replace its run, --resume to continue "
                              "it, or pick another --output-dir")
        for child in old:
            shutil.rmtree(child) if child.is_dir() else child.unlink()

    def lock(self) -> RunLock:
        return RunLock(self.path, self.machine_rank)


def open_run(accelerator, recipe: Recipe, output_dir=None, overwrite: bool = False, resume: bool = False) -> RunFolder:
    """The run folder, as the loop opens it: one name for all processes (runs/<recipe>-<time> unless named), a
    finished run refused unless overwritten or resumed, and, launched without `memrecipe run` (plain accelerate
    launch, the sbatch script), the resolved recipe and a launch config written as `memrecipe run` writes them,
    so that resume, report and export take the folder."""
    from dataclasses import replace

    from accelerate.utils import broadcast_object_list

    from ..files import write_files
    from ..planning.paths import absolute_paths
    from ..planning.topology import launched_topology

    name = [run_folder_name(recipe.name)]
    broadcast_object_list(name)  # the main process's clock: one folder name for all processes
    run = RunFolder(output_dir or name[0], script=recipe.script)  # named on the command line: each machine's own
    if run.final.exists() and not overwrite and not resume:
        raise RecipeError(f"{run.path} already holds a finished run: pass --overwrite, or another --output-dir")
    if accelerator.is_main_process:
        run.make()
        if not run.recipe.exists():
            topology = launched_topology(accelerator.num_processes, accelerator.device.type == "cpu",
                                         accelerator.mixed_precision == "bf16" or None)
            ran = replace(recipe, mixed_precision=accelerator.mixed_precision)  # the launch config's, which wins
            write_files(run.path, run_files(absolute_paths(ran), topology))
    return run


class RunLock:
    """One run per folder (per machine of a multi-machine run): `.lock` holds the owner's pid and
    host; a lock whose process is dead on this host is stale, named and taken over."""

    def __init__(self, folder: Path, machine_rank: int = 0):
        self.path = Path(folder) / (".lock" if machine_rank == 0 else f".lock.machine{machine_rank}")
        self.taken_over: str | None = None

    def check(self) -> None:
        """Refuse, in one line, a folder whose lock a live run holds."""
        try:
            pid, _, host = self.path.read_text().strip().partition(" ")
        except (FileNotFoundError, NotADirectoryError):
            return
        if not (host == socket.gethostname() and pid.isdigit() and not _alive(int(pid))):
            raise RecipeError(f"{self.path.parent} is in use by process {pid} on {host or 'this host'} "
                              f"(its .lock): wait for it, or remove the lock if that run is gone") from None

    def acquire(self) -> RunLock:
        me = f"{os.getpid()} {socket.gethostname()}"
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                self.check()  # a live owner: refused; a dead one's lock is stale, named and taken over
                try:
                    self.taken_over = self.path.read_text().strip().partition(" ")[0]
                except FileNotFoundError:  # released meanwhile
                    pass
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(me)
            return self
        raise RecipeError(f"cannot take {self.path}: another run keeps taking it")

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
