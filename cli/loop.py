"""Everything recipes/sft.py takes from memrecipe, in one place: a script copied into another repository
needs `pip install memrecipe` and these names, nothing else. Importing it first also quiets library
notices that say nothing about the run (memrecipe/__init__.py).

    recipes and errors  load_recipe, RecipeError
    the run folder      RunFolder, INITIAL_ADAPTER, LOSS_PLOT, write_files, run_files, absolute_paths,
                        launched_topology, LAUNCHED_BY
    setup               make_accelerator, embedded_model, load_tokenizer, load_base, add_lora, compile_layers,
                        rewrites_base, save_initial_adapter, fuse_head, prepare_datasets, Collator,
                        make_optimizer, wrap_first, prepare
    the loop            lm_loss, count_targets, window_counts, Checkpoints
    measuring           describe_setup, held_bytes, optimizer_state_dtypes, LossMemory, MemorySnapshot,
                        peak_memory, start_trackers
    the end             save_final, build_report, card, plot_loss
"""

from .errors import RecipeError
from .files import write_files
from .launching.launch import LAUNCHED_BY
from .launching.run_folder import INITIAL_ADAPTER, LOSS_PLOT, RunFolder, run_files
from .planning.paths import absolute_paths
from .planning.registry import load_recipe
from .planning.topology import launched_topology
from .plots import plot_loss
from .report import build as build_report
from .report import card
from .training.checkpoint import Checkpoints, save_final
from .training.data import Collator, prepare_datasets
from .training.device import quiet_deepspeed
from .training.loss import count_targets, fuse_head, lm_loss
from .training.measure import (LossMemory, MemorySnapshot, describe_setup, held_bytes, optimizer_state_dtypes,
                               peak_memory, start_trackers, window_counts)
from .training.modeling import (add_lora, compile_layers, embedded_model, load_base, load_tokenizer, make_accelerator,
                                prepare, rewrites_base, save_initial_adapter, wrap_first)
from .training.optimizers import make_optimizer

quiet_deepspeed()  # a plain accelerate launch without CUDA: name DeepSpeed's CPU accelerator before it is imported

__all__ = ["load_recipe", "RecipeError",
           "RunFolder", "INITIAL_ADAPTER", "LOSS_PLOT", "write_files", "run_files", "absolute_paths",
           "launched_topology", "LAUNCHED_BY",
           "make_accelerator", "embedded_model", "load_tokenizer", "load_base", "add_lora", "compile_layers",
           "rewrites_base", "save_initial_adapter", "fuse_head", "prepare_datasets", "Collator", "make_optimizer",
           "wrap_first", "prepare",
           "lm_loss", "count_targets", "window_counts", "Checkpoints",
           "describe_setup", "held_bytes", "optimizer_state_dtypes", "LossMemory", "MemorySnapshot", "peak_memory",
           "start_trackers",
           "save_final", "build_report", "card", "plot_loss"]
