"""Worker, one "machine" of a gloo world on one box: asks checkpoint.folder_sharing about its run folder.

    accelerate launch --multi_gpu --num_machines N --machine_rank I ... folder_sharing.py RUN_FOLDER RESULT.json

RESULT.json: {"machines": n, "shared": bool}, or {"error": the one-line refusal}."""

import json
import sys

from accelerate import Accelerator

from memrecipe.training.checkpoint import folder_sharing
from memrecipe.errors import RecipeError

folder, result = sys.argv[1:]
accelerator = Accelerator()
try:
    machines, shared = folder_sharing(accelerator, folder)
    answer = {"machines": machines, "shared": shared}
except RecipeError as e:
    answer = {"error": str(e)}
with open(result, "w") as f:
    json.dump(answer, f)
accelerator.wait_for_everyone()
accelerator.end_training()
