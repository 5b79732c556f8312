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
    names = [r.split(">")[0].split("=")[0] for r, _ in script().PRIORITY]
    assert names.index("datasets") < names.index("deepspeed") < names.index("bitsandbytes") == len(names) - 1
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "offline_wheels.py"), "--out", str(tmp_path / "w"),
                           "--dry-run"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.splitlines()[0].startswith("transformers>=5.23")
    assert not (tmp_path / "w").exists()  # a dry run writes nothing
