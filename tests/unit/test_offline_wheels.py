"""scripts/offline_wheels.py: the wheels a lent GPU box lacks, in priority order within the device tool's budget."""

import importlib.util
import subprocess
import sys

from helpers import REPO


def script():
    spec = importlib.util.spec_from_file_location("offline_wheels", REPO / "scripts" / "offline_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wheels_are_kept_in_priority_order_within_the_budget_and_what_does_not_fit_is_said():
    MiB = 2**20
    kept, left = script().pack([("transformers", 12 * MiB), ("pyarrow", 42 * MiB), ("deepspeed", 2 * MiB),
                                ("bitsandbytes", 70 * MiB), ("torchao", 6 * MiB)], 64 * MiB)
    assert [n for n, _ in kept] == ["transformers", "pyarrow", "deepspeed", "torchao"]
    assert left == [("bitsandbytes", 70 * MiB)]


def test_the_priority_puts_what_every_run_needs_first_and_bitsandbytes_last(tmp_path):
    names = [r.split(">")[0].split("=")[0] for r, _, _ in script().PRIORITY]
    assert names.index("datasets") < names.index("deepspeed") < names.index("bitsandbytes") == len(names) - 1
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "offline_wheels.py"), "--out", str(tmp_path / "w"),
                           "--dry-run"], capture_output=True, text=True)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and lines[0].startswith("memrecipe") and lines[1].startswith("transformers==5.2")
    assert not (tmp_path / "w").exists()  # a dry run writes nothing


def test_bitsandbytes_keeps_only_the_boxs_cuda_library_and_its_record_says_so(tmp_path):
    """Its wheel carries a library per CUDA and ROCm (43 MB); the box needs its CUDA's and the CPU one."""
    import zipfile

    libraries = ["libbitsandbytes_cpu.so", "libbitsandbytes_cuda126.so", "libbitsandbytes_cuda130.so",
                 "libbitsandbytes_rocm64.so"]
    names = ["bitsandbytes/__init__.py", *[f"bitsandbytes/{n}" for n in libraries]]
    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in names:
            z.writestr(name, b"x" * 1000)
        z.writestr("bitsandbytes-0.50.2.dist-info/RECORD", "\n".join(f"{n},sha256=x,1000" for n in names))
    script().slim(wheel, "130")
    with zipfile.ZipFile(wheel) as z:
        kept = sorted(z.namelist())
        record = z.read("bitsandbytes-0.50.2.dist-info/RECORD").decode().splitlines()
    assert kept == ["bitsandbytes-0.50.2.dist-info/RECORD", "bitsandbytes/__init__.py",
                    "bitsandbytes/libbitsandbytes_cpu.so", "bitsandbytes/libbitsandbytes_cuda130.so"]
    assert [line.split(",")[0] for line in record] == kept[1:]


def test_the_box_runs_the_working_trees_memrecipe_whatever_the_wheels_age(tmp_path):
    """--install puts the folder's wheels into SITE and then this repository's packages over the memrecipe its wheel
    held: a wheel built before the last commit (as .whl's was, the morning after the second lease) cannot make a
    lease test older code. A stale wheel here: an old __init__ and a module the repository no longer has."""
    import zipfile

    wheels = tmp_path / "whl"
    wheels.mkdir()
    files = {"memrecipe/__init__.py": "STALE = True\n", "memrecipe/gone.py": "", "memrecipe/recipes/sft.py": "old\n",
             "memrecipe-0.1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: memrecipe\nVersion: 0.1.0\n",
             "memrecipe-0.1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                "Tag: py3-none-any\n"}
    with zipfile.ZipFile(wheels / "memrecipe-0.1.0-py3-none-any.whl", "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr("memrecipe-0.1.0.dist-info/RECORD", "\n".join(f"{n},," for n in [*files, "RECORD"]))
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "offline_wheels.py"), "--out", str(wheels),
                           "--install", str(site)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (site / "memrecipe-0.1.0.dist-info").is_dir()  # the wheel was installed (its metadata stays)
    for installed, ours in [("memrecipe/__init__.py", "cli/memrecipe/__init__.py"), ("memrecipe/recipes/sft.py", "recipes/sft.py"),
                            ("memrecipe/accelerate_configs", "accelerate_configs"), ("memrecipe/data", "cli/memrecipe/data")]:
        mine, theirs = site / installed, REPO / ours
        if theirs.is_dir():
            assert sorted(p.name for p in mine.iterdir()) == sorted(p.name for p in theirs.iterdir()
                                                                     if p.name != "__pycache__")
        else:
            assert mine.read_bytes() == theirs.read_bytes()
    assert not (site / "memrecipe" / "gone.py").exists()
    missing = subprocess.run([sys.executable, str(REPO / "scripts" / "offline_wheels.py"), "--out",
                              str(tmp_path / "none"), "--install", str(site)], capture_output=True, text=True)
    assert missing.returncode == 1 and "holds no memrecipe wheel" in missing.stderr
