"""What this machine has: GPUs (count, memory, bf16), cores, host RAM."""

from __future__ import annotations

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
    def detect(cls) -> Machine:
        """Through torch: what a run uses."""
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        memory = torch.cuda.get_device_properties(0).total_memory if gpus else None
        bf16 = torch.cuda.is_bf16_supported() if gpus else None
        return cls(gpus, memory, bf16, os.cpu_count() or 1, host_memory())

    @classmethod
    def probe(cls) -> Machine:
        """Without torch (for `plan`): nvidia-smi, if there is one."""
        memory, count = None, 0
        if shutil.which("nvidia-smi"):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout.split()
                count, memory = len(out), int(float(out[0]) * 2**20) if out else None
            except (OSError, subprocess.SubprocessError, ValueError):
                pass
        return cls(count, memory, None, os.cpu_count() or 1, host_memory())


def host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return 0


def quiet_deepspeed() -> None:
    """Before importing DeepSpeed without a GPU: name its CPU accelerator (it warns when it guesses)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
