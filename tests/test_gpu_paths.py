"""GPU-only paths, checked where a CPU can check them: what the code decides from the GPU it is
told about (stubbed), the launch it would build, the files it would write. docs/gpu.md lists the
first command to run on a real GPU box for each."""

import os
import stat
from types import SimpleNamespace

import pytest
import torch

from memrecipe.generator import resolve_precision
from memrecipe.hardware import Machine
from memrecipe.registry import load_recipe
from memrecipe.topology import make_topology


@pytest.fixture
def volta(monkeypatch):
    """torch sees one GPU of compute capability 7.0 (V100), on which bf16 only runs emulated."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=0: SimpleNamespace(major=7, minor=0, total_memory=16 * 2**30))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)  # emulation works
    monkeypatch.setattr(torch.version, "hip", None)


def test_auto_precision_is_fp16_on_a_v100_although_torch_can_emulate_bf16(volta):
    assert torch.cuda.is_bf16_supported()  # what torch says by default: emulated bf16 counts
    machine = Machine.detect()
    assert machine.gpus == 1 and machine.bf16 is False
    topo = make_topology(1, bf16=machine.bf16)
    assert resolve_precision(load_recipe("single-gpu-lora"), topo) == "fp16"


@pytest.mark.parametrize("cap, bf16", [("7.0", False), ("8.0", True), (None, None)])
def test_plan_reads_the_compute_capability_from_nvidia_smi(tmp_path, monkeypatch, cap, bf16):
    """`plan` imports no torch: nvidia-smi says the capability (old drivers do not know the field)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase \"$1\" in\n  *memory.total*) echo 16384; echo 16384;;\n"
                   + (f"  *compute_cap*) echo {cap}; echo {cap};;\n" if cap else "")
                   + "  *) echo \"Field is not a valid field\" >&2; exit 2;;\nesac\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    machine = Machine.probe()
    assert (machine.gpus, machine.gpu_memory, machine.bf16) == (2, 16 * 2**30, bf16)


def test_a_gpu_deepspeed_launch_gives_each_rank_its_share_of_the_cores(monkeypatch, tmp_path):
    """torchrun sets 1 thread per process on a node with several; the launch says how many instead
    (what --dry-run prints is what `run` would execute)."""
    from click.testing import CliRunner

    from memrecipe.commands import run
    from memrecipe.main import cli

    node = Machine(gpus=8, gpu_memory=80 * 2**30, bf16=True, cores=96, host_memory=1024 * 2**30)
    monkeypatch.setattr(run.Machine, "detect", classmethod(lambda cls: node))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    words = ["run", "sft", "--num-processes", "8", "--dry-run", "--output-dir", str(tmp_path / "r")]
    done = CliRunner().invoke(cli, [*words, "--recipe", "zero3-offload"])
    assert done.exit_code == 0, done.output
    command = next(line for line in done.output.splitlines() if "accelerate" in line and "launch" in line)
    assert "OMP_NUM_THREADS=12" in command
    fsdp = CliRunner().invoke(cli, [*words, "--recipe", "fsdp"])
    assert fsdp.exit_code == 0 and "OMP_NUM_THREADS" not in fsdp.output  # FSDP computes on the GPUs only
