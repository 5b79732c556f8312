"""training/device.py: this machine as torch sees it, and DeepSpeed told which accelerator to load and asking
py-cpuinfo once."""

import os

from memrecipe.training.device import ask_cpu_once, detect_machine, quiet_deepspeed


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


def test_deepspeeds_op_flags_ask_py_cpuinfo_once_per_process(monkeypatch):
    """CPU Adam's compiler flags (the CPU's architecture, its SIMD width), as its load computes them, twice: four
    py-cpuinfo subprocesses without the cache, one with it, and the same flags."""
    import cpuinfo
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    asked = []
    real = cpuinfo.get_cpu_info

    def counted():
        asked.append(1)
        return real()

    monkeypatch.setattr(cpuinfo, "get_cpu_info", counted)
    uncached = [CPUAdamBuilder().cxx_args() for _ in range(2)]
    assert len(asked) == 4
    asked.clear()
    ask_cpu_once()
    assert [CPUAdamBuilder().cxx_args() for _ in range(2)] == uncached and len(asked) == 1
