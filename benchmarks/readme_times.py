"""The times the README and docs quote, measured as a user meets them: each command run whole, from a fresh folder,
several times, wall-clock min / median / max. Not a test: the figures go into the docs by hand, with the machine.

    python benchmarks/readme_times.py [--runs 3] [--skip-tests]

- the main job: `memrecipe run sft --recipe single-gpu-lora` (the README's first command, after the install);
- the DPO run on the embedded default: `memrecipe run dpo --recipe single-gpu-lora` (docs/dpo.md);
- the quick tests: `python -m pytest -q -m "not slow"` (the README), run once (`--skip-tests` leaves them out).

Each run gets a new empty folder, so the run folder is new; the embedded model is built once before (its cache
outlives a fresh clone's first run only by seconds). Close other work first: on 2 cores, anything else running
shows in the figures.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {
    "main job (run sft, single-gpu-lora, embedded)": [sys.executable, "-m", "memrecipe", "run", "sft", "--recipe",
                                                      "single-gpu-lora"],
    "DPO on the embedded default (run dpo, single-gpu-lora)": [sys.executable, "-m", "memrecipe", "run", "dpo",
                                                               "--recipe", "single-gpu-lora"],
}
TESTS = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider"]


def wall(command, cwd) -> float:
    tick = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - tick
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each command")
    parser.add_argument("--skip-tests", action="store_true", help="leave the quick tests out")
    args = parser.parse_args()
    subprocess.run([sys.executable, "-c", "from memrecipe.training.loading import embedded_model; embedded_model()"],
                   check=True, capture_output=True)
    rows = []
    for name, command in COMMANDS.items():
        times = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as folder:
                times.append(wall(command, folder))
        rows.append((name, times))
    if not args.skip_tests:
        rows.append(("quick tests (pytest -m 'not slow')", [wall(TESTS, REPO)]))
    print("| what | runs | wall s min / median / max |")
    print("|---|---|---|")
    for name, times in rows:
        print(f"| {name} | {len(times)} | {min(times):.1f} / {statistics.median(times):.1f} / {max(times):.1f} |")


if __name__ == "__main__":
    main()
