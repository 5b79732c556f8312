"""What torch sees of this machine: the GPUs a run will use, and the accelerator DeepSpeed should load."""

from __future__ import annotations

import os

import torch

from ..planning.hardware import Machine, host_memory, usable_cores


def detect_machine() -> Machine:
    """GPUs as torch counts them (what a launch uses), cores and host RAM."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    memory = torch.cuda.get_device_properties(0).total_memory if gpus else None
    # natively: torch counts emulated bf16 too (torch/cuda/__init__.py, is_bf16_supported), which is
    # slow on compute capability 7.x (V100, T4), where `auto` must mean fp16 with loss scaling
    bf16 = torch.cuda.is_bf16_supported(including_emulation=False) if gpus else None
    return Machine(gpus, memory, bf16, usable_cores(), host_memory())


def quiet_deepspeed() -> None:
    """Before importing DeepSpeed without a GPU: name its CPU accelerator (it warns when it guesses)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
