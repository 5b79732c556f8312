"""planning/gpus.py: the GPUs people rent, by name, at what CUDA shows of their memory."""

import json

import pytest

from conftest import REPO
from memrecipe.errors import RecipeError
from memrecipe.planning.gpus import GPUS, gpu_named


def test_a_gpu_is_named_as_people_write_it():
    assert gpu_named("h100") is gpu_named("H100 SXM") is GPUS["H100"]
    assert gpu_named("A100 40GB") is GPUS["A100-40GB"] and gpu_named("a100") is GPUS["A100-80GB"]
    assert gpu_named("rtx4090") is gpu_named("4090") is GPUS["RTX-4090"]
    with pytest.raises(RecipeError, match=r"--gpu H10 is not in memrecipe's GPU table \(did you mean 'H100'\?\)"):
        gpu_named("H10")


def test_the_h100s_memory_is_what_the_leased_box_reported():
    """The table's measured figure is the one the first GPU run's report.json recorded (torch's total_memory)."""
    report = json.loads((REPO / "benchmarks" / "gpu_results" / "2026-11-27-h100" / "adamw-8bit-resumed.report.json")
                        .read_text())
    assert "H100 80GB HBM3" in report["device"] and GPUS["H100"].memory == report["topology"]["gpu_memory"]
    assert all(g.memory < 150 * 2**30 and g.bf16_flops > 0 and g.bandwidth > 0 and g.host_link > 0
               and g.memory_source for g in GPUS.values())
