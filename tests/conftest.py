import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# No hub here: every test builds its models and data locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def run_cli(*args, cwd=None, env=None, timeout=180):
    """Run `python -m memrecipe ARGS` as a user would; returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "memrecipe", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli
