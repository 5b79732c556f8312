"""What this machine has: GPUs (count, memory, bf16), cores, host RAM, read without torch."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Machine:
    gpus: int
    gpu_memory: int | None  # bytes of one GPU
    bf16: bool | None
    cores: int
    host_memory: int  # bytes

    @classmethod
    def from_nvidia_smi(cls) -> Machine:
        """Without torch (for `plan`): nvidia-smi, if there is one. What a launch uses is
        torch's count (memrecipe.training.device.detect_machine)."""
        memory, count, bf16 = None, 0, None
        if shutil.which("nvidia-smi"):
            out = _smi("memory.total")
            count, memory = len(out), int(float(out[0]) * 2**20) if out else None
            cap = _smi("compute_cap")  # older drivers do not know the field: bf16 stays unknown
            bf16 = float(cap[0]) >= 8 if cap else None  # Ampere or newer
        return cls(count, memory, bf16, usable_cores(), host_memory())


def usable_cores() -> int:
    """The cores this process may run on: a Slurm allocation, taskset or a container's cpuset, not the machine's
    count (each launched process's thread share is taken from it; more threads than cores thrash)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.cache  # (read once: every CPU plan's estimate asks, and `plan` makes many)
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """This CPU's feature flags (the first processor's, Linux's /proc/cpuinfo); none where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _smi(field: str) -> list[str]:
    """One nvidia-smi field per GPU ([] if it cannot be read)."""
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10)
        values = done.stdout.split() if done.returncode == 0 else []
        return [v for v in values if float(v) >= 0]  # numbers only (ValueError otherwise)
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return 0

