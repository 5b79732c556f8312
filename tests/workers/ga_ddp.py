"""Worker: one accumulation window under 2-process DDP; rank 0 saves the synced gradients.
With a second argument `packed`, each micro batch's two sequences are packed into one row."""

import sys

import torch

from helpers import RECIPES, tiny_model, uneven_examples

sys.path.insert(0, str(RECIPES))
from sft import accumulate_window  # noqa: E402

from memrecipe.training.data import Collator, pack  # noqa: E402
from memrecipe.training.accelerator import make_accelerator  # noqa: E402
from memrecipe.planning.registry import load_recipe  # noqa: E402

recipe = load_recipe("adamw-8bit", ["gradient_accumulation_steps=2", "mixed_precision=no"])
accelerator = make_accelerator(recipe)
rank, world = accelerator.process_index, accelerator.num_processes
assert world == 2, world
model = accelerator.prepare(tiny_model())
examples, collate = uneven_examples(8), Collator(0)
# 8 sequences = 2 processes x 2 micro batches x 2 sequences; this rank takes its quarter pairs
pairs = [examples[rank * 4 + i * 2: rank * 4 + i * 2 + 2] for i in range(2)]
if sys.argv[2:] == ["packed"]:
    from datasets import Dataset

    pairs = [list(pack(Dataset.from_list(pair), 80)) for pair in pairs]  # one row of two documents
window = [collate(pair) for pair in pairs]
accumulate_window(model, window, accelerator)
if rank == 0:
    torch.save({n: p.grad for n, p in accelerator.unwrap_model(model).named_parameters()}, sys.argv[1])
accelerator.wait_for_everyone()  # rank 0 has written the file: both leave the process group together
accelerator.end_training()  # destroys it: a rank exiting with gloo's threads alive can abort (SIGABRT)
