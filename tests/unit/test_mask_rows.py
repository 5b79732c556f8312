"""benchmarks/mask_rows.py, the GPU box's check that sdpa under a dense mask reads the mask's right rows at long
lengths: run here on torch's CPU kernel, where it reads them, and against a kernel made to read rows from the wrong
place, which it must call wrong."""

import importlib.util
import subprocess
import sys

from helpers import REPO


def mask_rows():
    spec = importlib.util.spec_from_file_location("mask_rows", REPO / "benchmarks" / "mask_rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_kernel_reading_the_right_rows_passes_and_one_reading_a_wrapped_row_does_not(monkeypatch):
    module = mask_rows()
    assert module.check(1024, "cpu", None)["right"]
    sdpa = module.F.scaled_dot_product_attention

    def wrapped(q, k, v, attn_mask):  # the last 200 queries read the rows 1,000 before theirs, as a wrap would
        shifted = attn_mask.clone()
        shifted[:, :, -200:] = attn_mask[:, :, -1200:-1000]
        return sdpa(q, k, v, attn_mask=shifted)

    monkeypatch.setattr(module.F, "scaled_dot_product_attention", wrapped)
    wrong = module.check(2048, "cpu", None)
    assert not wrong["right"] and wrong["output_error"] > 0.1 * wrong["scale"]


def test_the_script_runs_on_cpu_and_refuses_cuda_without_a_gpu(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "mask_rows.py"), "--cpu", "--tokens", "512",
                           "--out", str(tmp_path / "rows.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "yes" in done.stdout and (tmp_path / "rows.json").stat().st_size > 0, done.stderr
    gpu = subprocess.run([sys.executable, str(REPO / "benchmarks" / "mask_rows.py"), "--tokens", "512"],
                         capture_output=True, text=True, timeout=120)
    assert gpu.returncode == 2 and "no CUDA device" in gpu.stderr
