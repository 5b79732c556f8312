"""Wheels for a GPU box without network: run on a networked machine (with memrecipe's install: building deepspeed's
wheel imports torch), it puts what the lent box lacks into one folder the device tool carries (64 MiB at most):

    python scripts/offline_wheels.py --out .whl             # on a networked machine, in the repository
    python scripts/offline_wheels.py --out .whl --dry-run   # what it would fetch, in order, without network
    python scripts/offline_wheels.py --out .whl --install /tmp/site && export PYTHONPATH=/tmp/site   # on the box

The box (seen on the first lease, 2026-11-26: docs/gpu-lease.md) has Python 3.12, torch 2.11 (CUDA 13.0), transformers 5.17,
accelerate 1.15, peft, pyarrow, pandas, fsspec, click, pyyaml, ninja, msgpack and py-cpuinfo; it lacks datasets (and
dill, multiprocess, xxhash), deepspeed (and hjson, pydantic), bitsandbytes, torchao and apollo-torch. transformers
travels at memrecipe's floor (the box's 5.17 is below it). PyPI has no deepspeed wheel: its sdist is built into one
here without its compiled ops (the box builds CPU Adam on first use: g++, ninja, nvcc and the Python headers are
there). bitsandbytes' wheel carries a library for every CUDA and ROCm (43 MB): only the box's CUDA's and the CPU one
are kept (7 MB). memrecipe's own wheel comes first. ~30 MB in all; a wheel past the budget is left out and said.

On the box, `--install SITE` puts every wheel of the folder into SITE (no network, no dependency resolution) and then
this repository's own package files over the memrecipe its wheel installed: a lease runs the code of the working tree
it was given, however old the wheel (which still gives the `memrecipe` command and the package's metadata).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# (requirement, why, with its dependencies): in the order they are kept
PRIORITY = [
    ("transformers==5.24.0", "memrecipe's floor (5.23); the box has 5.17", False),
    ("peft==0.21.2", "LoRA (the box's may be older)", False),
    ("datasets==5.2.0", "every run's data", False),
    ("dill==0.4.1", "datasets", False), ("multiprocess==0.70.19", "datasets", False), ("xxhash", "datasets", False),
    ("deepspeed==0.19.8", "zero2, zero3-offload, zero3-ulysses rows (built from its sdist)", False),
    ("hjson", "deepspeed", False), ("pydantic", "deepspeed (with pydantic-core and its small dependencies)", True),
    ("torchao==0.18.0", "single-gpu-full rows (8-bit AdamW)", False),
    ("apollo-torch==1.0.3", "the APOLLO row", False),
    ("trl==1.16.0", "the peer rows (TRL's SFTTrainer: benchmarks/peers.py)", False),
    ("bitsandbytes==0.50.2", "qlora, adamw-8bit, fsdp-qlora rows (slimmed to the box's CUDA)", False),
]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]  # pip matches a wheel's tag exactly: each one it may carry
REPO = Path(__file__).resolve().parents[1]
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


def download(requirement: str, dest: Path, python: str, deps: bool) -> list[Path]:
    """One requirement's wheel for the box's interpreter (deepspeed: its sdist, built here into a wheel)."""
    before = set(dest.iterdir())
    pip = [sys.executable, "-m", "pip"]
    if requirement.startswith("deepspeed"):
        with tempfile.TemporaryDirectory() as sdist:
            subprocess.run([*pip, "download", "--no-deps", "--no-binary", ":all:", "-d", sdist, requirement], check=True)
            subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dest),
                            *map(str, Path(sdist).iterdir())], check=True, env=os.environ | {"DS_BUILD_OPS": "0"})
    else:
        subprocess.run([*pip, "download", *([] if deps else ["--no-deps"]), "--only-binary=:all:", "--dest", str(dest),
                        "--python-version", python, "--implementation", "cp",
                        *[flag for p in PLATFORMS for flag in ("--platform", p)], requirement], check=True)
    return sorted(set(dest.iterdir()) - before)


def slim(wheel: Path, cuda: str) -> None:
    """bitsandbytes' wheel with only the CUDA `cuda` (e.g. 130) library and the CPU one, its RECORD to match."""
    keep = lambda name: not name.endswith(".so") or f"cuda{cuda}" in name or name.endswith("_cpu.so")  # noqa: E731
    slimmed = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as out:
        for info in source.infolist():
            if keep(info.filename):
                data = source.read(info)
                if info.filename.endswith("RECORD"):
                    data = b"\n".join(line for line in data.split(b"\n") if keep(line.split(b",")[0].decode()))
                out.writestr(info, data)
    slimmed.replace(wheel)


def install(wheels: Path, site: Path) -> None:
    """Every wheel of `wheels` into `site`, then memrecipe's packages from this repository over its wheel's (the
    folders pyproject.toml maps them from: cli/memrecipe/, its recipes/ and accelerate_configs/ links...)."""
    import tomllib  # (Python 3.11: the box has 3.12)

    if not any(wheels.glob("memrecipe-*.whl")):
        sys.exit(f"offline_wheels: {wheels} holds no memrecipe wheel: make the folder with --out {wheels} first")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                           str(site), *sorted(map(str, wheels.glob("*.whl")))])
    if done.returncode:
        sys.exit(f"offline_wheels: pip could not install {wheels} (its error above): wheels made for another "
                 f"Python than this {sys.version_info.major}.{sys.version_info.minor}? (--python when making them)")
    folders = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(site / "memrecipe", ignore_errors=True)  # (a module the repository no longer has goes too)
    for package, folder in sorted(folders.items()):  # `memrecipe` before the packages inside it
        shutil.copytree(REPO / folder, site.joinpath(*package.split(".")), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder the wheels go to (made if missing); "
                        "with --install, the folder they are read from")
    parser.add_argument("--budget-mib", type=int, default=60, help="the most the folder may hold (default 60: the "
                        "device tool carries 64 MiB with the repository)")
    parser.add_argument("--python", default="3.12", help="the box's Python version (default 3.12)")
    parser.add_argument("--cuda", default="130", help="the box's torch.version.cuda without the dot (default 130)")
    parser.add_argument("--dry-run", action="store_true", help="list what it would fetch, in order, and stop")
    parser.add_argument("--install", type=Path, metavar="SITE", help="on the box: install the folder's wheels into "
                        "SITE and this repository's memrecipe over its wheel's (then PYTHONPATH=SITE)")
    args = parser.parse_args()
    if args.install:
        return install(args.out, args.install)
    if args.dry_run:
        print(f"{'memrecipe':24} built from {REPO}")
        for requirement, why, _ in PRIORITY:
            print(f"{requirement:24} {why}")
        return
    if args.out.exists() and any(args.out.iterdir()):
        sys.exit(f"offline_wheels: {args.out} is not empty: name a new folder (nothing was downloaded)")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        leftover = not (REPO / "build").exists()  # setuptools' build folder, which the wheel leaves in the repository
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp,
                        str(REPO)], check=True)  # memrecipe itself, first
        if leftover:
            shutil.rmtree(REPO / "build", ignore_errors=True)
        fetched = [(path, path.stat().st_size) for path in Path(tmp).iterdir()]
        for requirement, _, deps in PRIORITY:
            for path in download(requirement, Path(tmp), args.python, deps):
                if path.name.startswith("bitsandbytes-"):
                    slim(path, args.cuda)
                fetched.append((path, path.stat().st_size))
        kept, left = pack([(str(path), size) for path, size in fetched], args.budget_mib * MiB)
        for name, _ in kept:
            Path(name).rename(args.out / Path(name).name)
    print(f"{args.out}: {len(kept)} wheels, {sum(s for _, s in kept) / MiB:.1f} MiB of {args.budget_mib}")
    for name, size in left:
        print(f"left out (over the budget): {Path(name).name} ({size / MiB:.1f} MiB)")


if __name__ == "__main__":
    main()
