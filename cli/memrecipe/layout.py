"""The run folder's layout: the names of the files in it, which machine owns which, and what a complete checkpoint
is. Both sides read it (the launcher writes the folder, the loop its checkpoints and final save), and nothing else
spells the name of a file in a run folder.

    runs/<recipe>-<YYYYmmdd-HHMMSS>/
        recipe.yaml, accelerate_config.yaml [+ deepspeed_config.json]   the resolved recipe, the launch
        train.log                                                       what the launch printed
        checkpoints/step-N/                                             whole or not at all (trainer_state.json last)
        initial_adapter/                                                PiSSA/OLoRA's adapter before training
        final/, report.json, loss.png                                   a finished run
        .lock                                                           the running launcher's pid and host

The other machines of a multi-machine run keep their own launch files, lock and log beside machine 0's
(`accelerate_config.machine1.yaml`, `.lock.machine1`): a folder may be shared by all of them, or not.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

RECIPE, LAUNCH_CONFIG, DEEPSPEED_CONFIG, TRAIN_LOG = "recipe.yaml", "accelerate_config.yaml", "deepspeed_config.json", "train.log"
CHECKPOINTS, INITIAL_ADAPTER, FINAL, REPORT, LOSS_PLOT = "checkpoints", "initial_adapter", "final", "report.json", "loss.png"
# What a run writes before its first checkpoint: a folder holding only these is a start that failed (a bad
# dataset, a bad model) and the same command may use it again; a checkpoint or a final save (or anything
# of the user's) keeps the folder protected.
STARTED = {RECIPE, LAUNCH_CONFIG, DEEPSPEED_CONFIG, TRAIN_LOG, INITIAL_ADAPTER}
MEMORY_RECORDS = "memory_"  # --memory-snapshot's files, per rank (measure.MemorySnapshot)
PROBE = ".probe-"  # the loop's look at whether the machines share the folder (checkpoint.folder_sharing)
STATE = "trainer_state.json"  # in a checkpoint: written last, so a checkpoint holding it is complete
NAME = re.compile(r"step-(\d+)$")  # checkpoints/step-N


def complete_checkpoints(out) -> list[Path]:
    """Complete checkpoints of a run folder, oldest first."""
    folder = Path(out) / CHECKPOINTS
    found = [p for p in folder.glob("step-*") if NAME.match(p.name) and (p / STATE).is_file()] if folder.is_dir() else []
    return sorted(found, key=lambda p: int(NAME.match(p.name).group(1)))


def checkpoint_files(checkpoint: Path) -> dict[str, int]:
    """Every file of a checkpoint being written, by its path in it: its size (written into its trainer state,
    so that a file lost or cut short later is known before a resume tries to load it)."""
    return {str(p.relative_to(checkpoint)): p.stat().st_size for p in sorted(checkpoint.rglob("*")) if p.is_file()}


def lost_files(checkpoint: Path) -> list[str]:
    """The files a complete checkpoint listed when it was written that are gone or of another size now (none for a
    checkpoint written before it listed them)."""
    listed = json.loads((checkpoint / STATE).read_text()).get("files", {})
    return [name for name, size in listed.items()
            if not (checkpoint / name).is_file() or (checkpoint / name).stat().st_size != size]


def machine_file(name: str, machine_rank: int = 0) -> str:
    """A launch file's name in the run folder: machine rank 0 owns the plain names; the other machines
    of a multi-machine run (sharing the folder, or not) keep their own, e.g. accelerate_config.machine1.yaml."""
    if machine_rank == 0:
        return name
    stem, dot, suffix = name.rpartition(".")
    return f"{stem}.machine{machine_rank}{dot}{suffix}"
