"""What the loop's measurements cost, against the training step they measure, in one process.

    python benchmarks/measure_cost.py

Per step the loop counts real tokens and reduces them across processes; once, after the first
optimizer step, it sums what each process holds (held_bytes); at the end it reads peak memory.
"""

import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import memrecipe  # noqa: F401  (first: quiets library notices)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # loop_model: the loop's own model setup

from sft import accumulate_window  # noqa: E402

from helpers import loop_model  # noqa: E402
from memrecipe.training.data import Collator, prepare_datasets  # noqa: E402
from memrecipe.training.probes import held_bytes, optimizer_state_dtypes, peak_memory  # noqa: E402
from memrecipe.training.accelerator import make_accelerator  # noqa: E402
from memrecipe.training.loading import embedded_model
from memrecipe.training.tokenizer import load_tokenizer
from memrecipe.training.optimizers import make_optimizer  # noqa: E402
from memrecipe.planning.registry import load_recipe  # noqa: E402


def timed(fn, repeat):
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main():
    recipe = load_recipe("single-gpu-lora")
    accelerator = make_accelerator(recipe)
    path = embedded_model()
    tokenizer = load_tokenizer(path)
    model, _ = loop_model(recipe, path, accelerator.mixed_precision)
    optimizer = make_optimizer(recipe, model, SimpleNamespace(device=accelerator.device))
    model, optimizer = accelerator.prepare(model, optimizer)
    train, _ = prepare_datasets(recipe, tokenizer)
    collate = Collator(tokenizer.pad_token_id)
    window = [collate([train[i * 4 + j] for j in range(4)]) for i in range(recipe.gradient_accumulation_steps)]

    def step():
        accumulate_window(model, window, accelerator)
        optimizer.step()
        optimizer.zero_grad()

    def per_step():
        tokens = sum(int(b["attention_mask"].sum()) for b in window)
        accelerator.reduce(torch.tensor(tokens, device=accelerator.device), "sum")
        time.perf_counter()

    def once():
        held_bytes(model, optimizer)
        optimizer_state_dtypes(optimizer)
        peak_memory(accelerator.device)

    step()  # warm-up, and the optimizer state exists
    base = timed(step, 10)
    each = timed(per_step, 200)
    single = timed(once, 20)
    print(f"training step (baseline)              {base * 1e3:8.1f} ms")
    print(f"per-step measurement                  {each * 1e3:8.3f} ms  ({each / base:.3%} of a step)")
    print(f"one-off measurement (held bytes, ...)  {single * 1e3:8.3f} ms  ({single / base:.3%} of one step)")


if __name__ == "__main__":
    main()
