"""training/device.py: this machine as torch sees it, and DeepSpeed told which accelerator to load."""

import os

from memrecipe.training.device import detect_machine, quiet_deepspeed


def test_a_machine_without_gpus_is_cores_and_host_ram():
    machine = detect_machine()
    assert (machine.gpus, machine.gpu_memory, machine.bf16) == (0, None, None)
    assert 1 <= machine.cores <= len(os.sched_getaffinity(0)) and machine.host_memory > 2**30


def test_deepspeed_is_told_to_load_its_cpu_accelerator_unless_the_user_named_one(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    quiet_deepspeed()
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "mine")
    quiet_deepspeed()
    assert os.environ["DS_ACCELERATOR"] == "mine"
