"""Wheels for a GPU box without network: run on a networked machine, it downloads what the lent box lacks (it comes
with torch 2.11, transformers 5.17 and accelerate 1.15; no datasets, bitsandbytes, deepspeed, torchao, apollo-torch
or trl) into one folder, in priority order, until a size budget (the device tool carries 64 MiB at most):

    python scripts/offline_wheels.py --out wheels             # on a networked machine
    python scripts/offline_wheels.py --out wheels --dry-run   # what it would fetch, in order, without network
    pip install --no-index --find-links wheels --no-deps -e . # on the box (docs/gpu.md)

Priority: what every `memrecipe run` needs first (transformers at memrecipe's floor, peft, datasets and pyarrow and
their small dependencies), then what whole acceptance rows need (deepspeed: zero2, zero3-offload; torchao:
single-gpu-full; apollo-torch: its APOLLO row), last bitsandbytes (~70 MB with its CUDA kernels: past the budget
beside pyarrow; without it the qlora, adamw-8bit and fsdp-qlora rows are skipped with the reason). What does not fit
is said, with its size. Wheels for the box's Python and platform (--python, --platform).
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

# (requirement, why): in the order they are kept; each with its own dependencies the box lacks
PRIORITY = [
    ("transformers>=5.23", "memrecipe's floor; the box has 5.17"),
    ("peft>=0.21.2", "LoRA"),
    ("datasets>=5.2", "every run's data"),
    ("pyarrow", "datasets' storage"),
    ("dill", "datasets"), ("xxhash", "datasets"), ("multiprocess", "datasets"), ("fsspec", "datasets"),
    ("click>=8.1", "the CLI"), ("pyyaml>=6.0", "recipes"),
    ("deepspeed>=0.19.8", "zero2, zero3-offload rows"), ("hjson", "deepspeed"), ("ninja", "deepspeed's CPU Adam build"),
    ("py-cpuinfo", "deepspeed"), ("msgpack", "deepspeed"),
    ("torchao>=0.18", "single-gpu-full rows (8-bit AdamW)"),
    ("apollo-torch>=1.0.3", "the APOLLO row"),
    ("bitsandbytes>=0.50.2", "qlora, adamw-8bit, fsdp-qlora rows"),
]
MiB = 2**20


def pack(wheels: list[tuple[str, int]], budget: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(kept, left out): wheels taken in priority order while they fit the budget; one that does not fit is left out
    and the smaller ones after it may still be kept."""
    kept, left, used = [], [], 0
    for name, size in wheels:
        if used + size <= budget:
            kept.append((name, size))
            used += size
        else:
            left.append((name, size))
    return kept, left


def download(requirement: str, dest: Path, python: str, platform: str) -> list[Path]:
    """One requirement's wheel (no dependencies: the list above names them), for the box's interpreter."""
    before = set(dest.iterdir())
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
                    "--python-version", python, "--platform", platform, requirement], check=True)
    return sorted(set(dest.iterdir()) - before)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder the wheels go to (made if missing)")
    parser.add_argument("--budget-mib", type=int, default=64, help="the most the folder may hold (default 64)")
    parser.add_argument("--python", default="3.11", help="the box's Python version (default 3.11)")
    parser.add_argument("--platform", default="manylinux2014_x86_64", help="the box's wheel platform")
    parser.add_argument("--dry-run", action="store_true", help="list what it would fetch, in order, and stop")
    args = parser.parse_args()
    if args.dry_run:
        for requirement, why in PRIORITY:
            print(f"{requirement:24} {why}")
        return
    if args.out.exists() and any(args.out.iterdir()):
        sys.exit(f"offline_wheels: {args.out} is not empty: name a new folder (nothing was downloaded)")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        fetched = []
        for requirement, _ in PRIORITY:
            fetched += [(path, path.stat().st_size) for path in download(requirement, Path(tmp), args.python,
                                                                          args.platform)]
        kept, left = pack([(str(path), size) for path, size in fetched], args.budget_mib * MiB)
        for name, _ in kept:
            Path(name).rename(args.out / Path(name).name)
    print(f"{args.out}: {len(kept)} wheels, {sum(s for _, s in kept) / MiB:.1f} MiB of {args.budget_mib}")
    for name, size in left:
        print(f"left out (over the budget): {Path(name).name} ({size / MiB:.1f} MiB)")


if __name__ == "__main__":
    main()
