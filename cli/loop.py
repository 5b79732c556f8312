"""Everything a loop script (recipes/sft.py) takes from memrecipe, in one place: a script copied into another
repository needs `pip install memrecipe` and these names, nothing else. Importing it first also quiets library
notices that say nothing about the run (memrecipe/__init__.py).

    the recipe      load_recipe, flag_overrides, RecipeError
    the run folder  open_run
    the model       make_accelerator, embedded_model, load_tokenizer, load_pretrained, tensor_parallel,
                    enable_checkpointing, add_lora, compile_layers, keep_initial_adapter, fuse_head, frozen_copy
    the data        prepare_datasets, Collator
    the optimizer   make_optimizer, wrap_first, prepare
    a step          lm_loss, count_targets, Checkpoints
    preferences     prepare_pairs, PairCollator, sequence_logps, target_counts, pair_values, preference_sums,
                    window_loss, METRICS, reference_store, reference_weights, rows_key, REFERENCE_STORE
                    (recipes/dpo.py)
    the end         Meter, save_final, write_report

The names a loop script took before 0.2 (RunFolder, load_base, build_report, ...) still import from here, with a
FutureWarning naming what replaced them; they go in the release after.
"""

import importlib
import warnings

from .errors import RecipeError
from .launching.run_folder import open_run
from .planning.registry import flag_overrides, load_recipe
from .report import write_report
from .training.checkpoint import Checkpoints, save_final
from .training.data import Collator, prepare_datasets
from .training.device import quiet_deepspeed
from .training.loss import count_targets, fuse_head, lm_loss
from .training.measure import Meter
from .training.modeling import (add_lora, compile_layers, embedded_model, enable_checkpointing, frozen_copy,
                                keep_initial_adapter, load_pretrained, load_tokenizer, make_accelerator, prepare,
                                tensor_parallel, wrap_first)
from .training.optimizers import make_optimizer
from .training.preference import (METRICS, REFERENCE_STORE, PairCollator, pair_values, preference_sums, prepare_pairs,
                                  reference_store, reference_weights, rows_key, sequence_logps, target_counts,
                                  window_loss)

quiet_deepspeed()  # a plain accelerate launch without CUDA: name DeepSpeed's CPU accelerator before it is imported

__all__ = ["load_recipe", "flag_overrides", "RecipeError",
           "open_run",
           "make_accelerator", "embedded_model", "load_tokenizer", "load_pretrained", "tensor_parallel",
           "enable_checkpointing", "add_lora", "compile_layers", "keep_initial_adapter", "fuse_head", "frozen_copy",
           "prepare_datasets", "Collator",
           "make_optimizer", "wrap_first", "prepare",
           "lm_loss", "count_targets", "Checkpoints",
           "prepare_pairs", "PairCollator", "sequence_logps", "target_counts", "pair_values", "preference_sums",
           "window_loss", "METRICS",
           "reference_store", "reference_weights", "rows_key", "REFERENCE_STORE",
           "Meter", "save_final", "write_report"]

# name -> (module, its name there, what replaces it)
DEPRECATED = {
    "RunFolder": ("launching.run_folder", "RunFolder", "open_run"),
    "INITIAL_ADAPTER": ("launching.run_folder", "INITIAL_ADAPTER", "open_run(...).initial_adapter"),
    "LOSS_PLOT": ("launching.run_folder", "LOSS_PLOT", "write_report"),
    "write_files": ("files", "write_files", "open_run"),
    "run_files": ("launching.run_folder", "run_files", "open_run"),
    "absolute_paths": ("planning.paths", "absolute_paths", "open_run"),
    "launched_topology": ("planning.topology", "launched_topology", "open_run"),
    "LAUNCHED_BY": ("launching.launch", "LAUNCHED_BY", "open_run(...).resume_hint()"),
    "load_base": ("training.modeling", "load_base", "load_pretrained, tensor_parallel and enable_checkpointing"),
    "rewrites_base": ("training.modeling", "rewrites_base", "keep_initial_adapter"),
    "save_initial_adapter": ("training.modeling", "save_initial_adapter", "keep_initial_adapter"),
    "describe_setup": ("training.measure", "describe_setup", "Meter"),
    "held_bytes": ("training.measure", "held_bytes", "Meter"),
    "optimizer_state_dtypes": ("training.measure", "optimizer_state_dtypes", "Meter"),
    "LossMemory": ("training.measure", "LossMemory", "Meter"),
    "MemorySnapshot": ("training.measure", "MemorySnapshot", "Meter"),
    "peak_memory": ("training.measure", "peak_memory", "Meter"),
    "start_trackers": ("training.measure", "start_trackers", "Meter"),
    "window_counts": ("training.measure", "window_counts", "Meter"),
    "build_report": ("loop", "_build_report", "Meter.finish and write_report"),
    "card": ("report", "card", "write_report"),
    "plot_loss": ("plots", "plot_loss", "write_report"),
}


def __getattr__(name):
    if name not in DEPRECATED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute, instead = DEPRECATED[name]
    warnings.warn(f"memrecipe.loop.{name} is deprecated and goes in the next release: use {instead} "
                  "(recipes/sft.py shows how; memrecipe cp gives a fresh copy)", FutureWarning, stacklevel=2)
    if module == "loop":
        return globals()[attribute]
    return getattr(importlib.import_module(f"{__package__}.{module}"), attribute)


def _build_report(out, recipe, accelerator, model_path, setup, history, ranks, wall, eval_loss) -> dict:
    """report.build as it was called before 0.2 (nine arguments)."""
    from .report import build
    from .training.measure import Measured

    return build(out, recipe, accelerator, model_path, Measured(setup, history, ranks, wall, eval_loss))
