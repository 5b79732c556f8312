"""Everything a loop script (recipes/sft.py) takes from memrecipe, in one place: a script copied into another
repository needs `pip install memrecipe` and these names, nothing else. Importing it first also quiets library
notices that say nothing about the run (memrecipe/__init__.py).

    the recipe      load_recipe, flag_overrides, Recipe, RecipeError
    the run folder  open_run, RunFolder
    the model       make_accelerator, embedded_model, load_tokenizer, load_pretrained, tensor_parallel,
                    apply_rungs (each activation rung the recipe stands on: planning/rungs.py), add_lora,
                    compile_layers, keep_initial_adapter, fuse_head, frozen_copy
    the data        prepare_datasets, Collator
    the optimizer   make_optimizer, wrap_first, prepare
    a step          lm_loss, count_targets, Checkpoints, Ring, skip_batches
    preferences     prepare_pairs, PairCollator, sequence_logps, target_counts, pair_values, preference_sums,
                    window_loss, METRICS, reference_store, reference_weights, rows_key, REFERENCE_STORE
                    (recipes/dpo.py)
    the end         Meter, save_final, write_report
"""

from .errors import RecipeError
from .launching.run_folder import RunFolder, open_run
from .planning.recipe import Recipe
from .planning.registry import flag_overrides, load_recipe
from .report import write_report
from .training.accelerator import make_accelerator, prepare, wrap_first
from .training.adapters import add_lora, keep_initial_adapter
from .training.checkpoint import Checkpoints, save_final
from .training.data import Collator, prepare_datasets
from .training.device import quiet_deepspeed
from .training.layers import compile_layers, tensor_parallel
from .training.loading import embedded_model, load_pretrained
from .training.loss import count_targets, fuse_head, lm_loss
from .training.meter import Meter
from .training.optimizers import make_optimizer
from .training.preference import (METRICS, REFERENCE_STORE, PairCollator, pair_values, preference_sums, prepare_pairs,
                                  reference_store, reference_weights, rows_key, sequence_logps, target_counts,
                                  window_loss)
from .training.reference import frozen_copy
from .training.ring import Ring
from .training.rungs import apply_rungs
from .training.sequence import skip_batches
from .training.tokenizer import load_tokenizer

quiet_deepspeed()  # a plain accelerate launch without CUDA: name DeepSpeed's CPU accelerator before it is imported

__all__ = ["load_recipe", "flag_overrides", "Recipe", "RecipeError",
           "open_run", "RunFolder",
           "make_accelerator", "embedded_model", "load_tokenizer", "load_pretrained", "tensor_parallel",
           "apply_rungs", "add_lora", "compile_layers", "keep_initial_adapter", "fuse_head", "frozen_copy",
           "prepare_datasets", "Collator",
           "make_optimizer", "wrap_first", "prepare",
           "lm_loss", "count_targets", "Checkpoints", "Ring", "skip_batches",
           "prepare_pairs", "PairCollator", "sequence_logps", "target_counts", "pair_values", "preference_sums",
           "window_loss", "METRICS",
           "reference_store", "reference_weights", "rows_key", "REFERENCE_STORE",
           "Meter", "save_final", "write_report"]
