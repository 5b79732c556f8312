"""The loop's side of the activation ladder: each rung the recipe stands on, applied by its own module (the `hook` of
its entry in planning/rungs.py, a module of memrecipe.training with an apply(model, recipe, accelerator))."""

from __future__ import annotations

from importlib import import_module

from ..planning.rungs import LADDER


def apply_rungs(model, recipe, accelerator, after_adapters: bool) -> dict:
    """Each rung the recipe stands on whose module applies it at this point of the setup (before the LoRA adapters
    are added, or after: the rung's `after_adapters`), in the ladder's order, each module once (selective, full
    checkpointing and the offload share one). Returns {module: what its apply returned} (layers: the offload's hooks)."""
    done = {}
    for technique in LADDER:
        if technique.hook and technique.after_adapters == after_adapters and technique.on(recipe, None) \
                and technique.hook not in done:
            done[technique.hook] = import_module(f"{__package__}.{technique.hook}").apply(model, recipe, accelerator)
    return done
