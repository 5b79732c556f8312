"""The loss from the full logits (plain) against the fused, chunked loss, in one process on CPU: the
loss's peak bytes (LossMemory, the report card's measurement) and seconds per training step.

    python benchmarks/loss_memory.py [--steps 7]

Two cases, each trained by the single-gpu-lora recipe's model code (LoRA all-linear, checkpointing,
bf16 autocast): a model whose vocabulary dominates (32k vocabulary, 2 x 1024 tokens, every token a
target, as in plain-text data), and the embedded default on its chat data (only the assistant's
tokens are targets, so the fused head skips the rest). Plain and fused steps alternate on the same
batches; the figures are medians.
"""

import argparse
import copy
import statistics
import tempfile
import sys
import time
from pathlib import Path

import memrecipe  # noqa: F401  (first: quiets library notices)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # loop_model: the loop's own model setup

from helpers import loop_model  # noqa: E402
from memrecipe.training.data import Collator, prepare_datasets
from memrecipe.training.loss import count_targets, fuse_head, lm_loss
from memrecipe.training.measure import LossMemory
from memrecipe.training.modeling import embedded_model, load_tokenizer
from memrecipe.planning.registry import load_recipe

BIG_VOCAB = {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
             "tie_word_embeddings": False}


def big_vocab_case(folder):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**BIG_VOCAB)).save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, BIG_VOCAB["vocab_size"], (2, 1024), generator=g)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return folder, batches


def embedded_case():
    recipe = load_recipe("single-gpu-lora")
    path = embedded_model()
    train, _ = prepare_datasets(recipe, load_tokenizer(path))
    collate = Collator(load_tokenizer(path).pad_token_id)
    size = recipe.per_device_train_batch_size
    return path, [collate([train[i * size + j] for j in range(size)]) for i in range(recipe.gradient_accumulation_steps)]


def trainer(model, window):
    """One optimizer step over the window, loss normalised by its target tokens (as the loop does)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    targets = sum(count_targets(b["labels"]) for b in window)

    def step():
        for batch in window:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = lm_loss(model, batch) / targets
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


def loss_peak(model, batch):
    memory = LossMemory(model, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(model, batch)
    loss.backward()
    model.zero_grad()
    return memory.bytes


def compare(name, path, window, steps):
    recipe = load_recipe("single-gpu-lora")
    plain, _ = loop_model(recipe, path, "bf16")
    plain.train()
    fused = copy.deepcopy(plain)
    fuse_head(fused)
    peaks = {"plain": loss_peak(plain, window[0]), "fused": loss_peak(fused, window[0])}
    steppers = {"plain": trainer(plain, window), "fused": trainer(fused, window)}
    for run in steppers.values():
        run()  # warm-up
    times = {k: [] for k in steppers}
    for _ in range(steps):  # interleaved: the machine's drift hits both alike
        for key, run in steppers.items():
            start = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - start)
    seconds = {k: statistics.median(v) for k, v in times.items()}
    share = sum(count_targets(b["labels"]) for b in window) / sum(b["labels"].numel() for b in window)
    print(f"\n{name}: {share:.0%} of the positions are targets")
    print(f"{'loss':6} {'loss peak MiB':>14} {'s/step':>8}")
    for key in ("plain", "fused"):
        print(f"{key:6} {peaks[key] / 2**20:14.1f} {seconds[key]:8.3f}")
    print(f"fused: {peaks['plain'] / peaks['fused']:.1f}x less memory at the loss, "
          f"{seconds['plain'] / seconds['fused']:.2f}x the speed of plain")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=7, help="timed steps per path (median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        compare("vocabulary 32k, 2 x 1024 tokens", *big_vocab_case(folder), args.steps)
    compare("embedded default, chat data (micro batch 4 x accumulation 4)", *embedded_case(), args.steps)


if __name__ == "__main__":
    main()
