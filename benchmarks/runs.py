"""What the benchmarks share: one training run through `memrecipe run` (the real loop), its report."""

import json
import subprocess
import sys
from pathlib import Path


def memrecipe_run(folder: Path, recipe: str, *words: str) -> dict:
    """`memrecipe run sft --recipe RECIPE --output-dir FOLDER WORDS...`; its report.json (exits with the
    run's last error lines if it fails)."""
    cmd = [sys.executable, "-m", "memrecipe", "run", "sft", "--recipe", recipe, "--output-dir", str(folder), *words]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr[-2000:])
    return json.loads((Path(folder) / "report.json").read_text())
