"""memrecipe.loop, the surface a loop script imports: small and documented (a copied loop runs under plain
accelerate launch against it: tests/runs/test_recipes_run.py, the copied single-gpu-lora run)."""

import ast

from conftest import REPO


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
        # the training concepts, not one name per memory technique: when it is full, merge names into a table entry
        # (a rung is an entry of planning/rungs.py, which apply_rungs applies), do not raise the number
        assert len(names) <= 30, (f"{script} imports {len(names)} names from memrecipe.loop, over 30: merge names into "
                                  "a table entry (as apply_rungs runs every rung of planning/rungs.py), not raise the "
                                  "cap")
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        assert names <= used, script  # nothing imported that the script does not use
        imported |= names
    assert imported == set(surface.__all__)
    assert [name for name in surface.__all__ if name not in surface.__doc__.replace(",", " ").split()] == []
