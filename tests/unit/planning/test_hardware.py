"""hardware.py: what this machine has, read without torch."""

import os
import stat

import pytest

from memrecipe.planning.hardware import Machine


@pytest.mark.parametrize("cap, bf16", [("7.0", False), ("8.0", True), (None, None)])
def test_plan_reads_the_compute_capability_from_nvidia_smi(tmp_path, monkeypatch, cap, bf16):
    """`plan` imports no torch: nvidia-smi says the capability (old drivers do not know the field)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase \"$1\" in\n  *memory.total*) echo 16384; echo 16384;;\n"
                   + (f"  *compute_cap*) echo {cap}; echo {cap};;\n" if cap else "")
                   + "  *) echo \"Field is not a valid field\" >&2; exit 2;;\nesac\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    machine = Machine.from_nvidia_smi()
    assert (machine.gpus, machine.gpu_memory, machine.bf16) == (2, 16 * 2**30, bf16)
