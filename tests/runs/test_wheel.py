"""The built wheel carries recipes/ and accelerate_configs/ and works from any folder."""

import subprocess
import sys
import venv
import zipfile

import pytest

from conftest import REPO


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_installs_and_runs_outside_the_repo(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(REPO)], check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("memrecipe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "memrecipe/recipes/fsdp.yaml" in names and "memrecipe/recipes/sft.py" in names
    assert "memrecipe/data/chat.jsonl" in names and "memrecipe/data/tiny-llama/tokenizer.json" in names
    assert "memrecipe/accelerate_configs/zero3_offload_8gpu.json" in names
    assert not any(n.startswith("cli/") for n in names), "a top-level `cli` package must never be installed"

    # a venv that reuses the installed dependencies (torch & co.) but has its own memrecipe
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True, timeout=300,
                   capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(py), "-c", "import memrecipe; print(memrecipe.__file__)"], cwd=elsewhere,
                           capture_output=True, text=True, check=True)
    assert str(env_dir) in where.stdout, "the test must exercise the wheel, not the checkout"
    memrecipe = env_dir / "bin" / "memrecipe"
    ls = subprocess.run([str(memrecipe), "ls"], cwd=elsewhere, capture_output=True, text=True, timeout=60)
    assert ls.returncode == 0 and "zero3-offload" in ls.stdout, ls.stderr
    cfg = subprocess.run([str(memrecipe), "config", "fsdp"], cwd=elsewhere, capture_output=True, text=True, timeout=60)
    assert cfg.returncode == 0 and "distributed_type: FSDP" in cfg.stdout, cfg.stderr
