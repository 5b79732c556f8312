"""memrecipe.loop, the surface a loop script imports: small, documented, and kind to scripts copied before it
changed (a copy of recipes/sft.py as 0.1 shipped it still runs, told what replaced its names)."""

import ast
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

OLD_SCRIPT = REPO / "tests" / "fixtures" / "sft_0_1.py"  # recipes/sft.py as memrecipe 0.1 shipped it, unchanged


def test_the_loop_takes_everything_from_memrecipe_through_one_documented_surface():
    """recipes/sft.py and recipes/dpo.py import memrecipe names from memrecipe.loop only; that module's __all__ is
    exactly what the two scripts use, and its docstring lists every name."""
    import memrecipe.loop as surface

    imported = set()
    for script in ("sft.py", "dpo.py"):
        tree = ast.parse((REPO / "recipes" / script).read_text())
        imports = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and node.module.startswith("memrecipe")]
        assert {node.module for node in imports} == {"memrecipe.loop"}, script
        assert not [node for node in ast.walk(tree) if isinstance(node, ast.Import)
                    and any(alias.name.startswith("memrecipe") for alias in node.names)]
        names = {alias.name for node in imports for alias in node.names}
        assert len(names) <= 25, (script, len(names))  # the training concepts, not the library's bookkeeping
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        assert names <= used, script  # nothing imported that the script does not use
        imported |= names
    assert imported == set(surface.__all__)
    assert [name for name in surface.__all__ if name not in surface.__doc__.replace(",", " ").split()] == []


def test_the_names_that_left_the_surface_still_import_with_a_warning():
    import memrecipe.loop as surface

    tree = ast.parse(OLD_SCRIPT.read_text())
    old = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "memrecipe.loop"
           for alias in node.names}
    assert len(old) == 39
    for name in sorted(old - set(surface.__all__)):
        with pytest.warns(FutureWarning, match=f"memrecipe.loop.{name} is deprecated"):
            assert getattr(surface, name) is not None
    with pytest.raises(AttributeError):
        surface.no_such_name  # noqa: B018


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_loop_script_copied_from_0_1_still_trains(tmp_path):
    """A user's copy of 0.1's recipes/sft.py (39 names, report.build's nine arguments, load_base) runs against
    this library: it trains, saves and reports, and says which names to move off."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, str(OLD_SCRIPT), "--recipe", "single-gpu-lora", "--output-dir", str(out),
                           "max_steps=3", "eval_steps=null"], capture_output=True, text=True, timeout=280,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    losses = [r["loss"] for r in report["history"]]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert (out / "final" / "adapter_model.safetensors").stat().st_size > 0
    assert "memrecipe.loop.load_base is deprecated" in done.stderr
