"""What torch sees of this machine: the GPUs a run will use, and what DeepSpeed is told of it (the accelerator to
load, the CPU its C++ ops are built for)."""

from __future__ import annotations

import functools
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


def ask_cpu_once() -> None:
    """DeepSpeed's CPU Adam asks py-cpuinfo about the CPU three times as it starts (its constructor for the vendor,
    then the op's compiler flags, built or not: CPUOpBuilder.cxx_args' cpu_arch and simd_width, in
    deepspeed/ops/op_builder/builder.py), and each answer is a Python subprocess of ~1.4 s. The CPU does not change
    while a process runs: py-cpuinfo is asked once (a 2-process zero3-offload launch on CPU: 19.6 -> 16.0 s)."""
    try:
        import cpuinfo  # (DeepSpeed's dependency; its import runs `uname`: only for DeepSpeed runs)
    except ImportError:
        return
    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)  # (builder.py imports it at each call)
