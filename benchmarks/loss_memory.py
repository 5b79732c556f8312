"""The loss from the full logits (plain) against the fused, chunked loss, in one process on CPU: the
loss's peak bytes (LossMemory, the report card's measurement) and seconds per training step.

    python benchmarks/loss_memory.py [--steps 7]
    python benchmarks/loss_memory.py --chunks     # the fused loss's chunk size: bytes held, head re-reads

Two cases, each trained by the single-gpu-lora recipe's model code (LoRA all-linear, checkpointing,
bf16 autocast): a model whose vocabulary dominates (32k vocabulary, 2 x 1024 tokens, every token a
target, as in plain-text data), and the embedded default on its chat data (only the assistant's
tokens are targets, so the fused head skips the rest). Plain and fused steps alternate on the same
batches; the figures are medians.
"""

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import memrecipe  # noqa: F401  (first: quiets library notices)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # loop_model: the loop's own model setup

from helpers import loop_model  # noqa: E402
from model_configs import LLAMA_8B  # noqa: E402
from memrecipe.training.data import Collator, prepare_datasets
from memrecipe.training.loss import count_targets, fuse_head, lm_loss
from memrecipe.training.probes import LossMemory
from memrecipe.training.loading import embedded_model
from memrecipe.training.tokenizer import load_tokenizer
from memrecipe.planning.architecture import structure
from memrecipe.planning.planner import estimate
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology

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
    targets = sum(count_targets(b) for b in window)

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
    plain, _ = loop_model(load_recipe("single-gpu-lora", ["fused_loss=false"]), path, "bf16")
    plain.train()
    fused = copy.deepcopy(plain)
    fuse_head(fused)  # (the loop's setup, fused_loss: true)
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
    share = sum(count_targets(b) for b in window) / sum(b["labels"].numel() for b in window)
    print(f"\n{name}: {share:.0%} of the positions are targets")
    print(f"{'loss':6} {'loss peak MiB':>14} {'s/step':>8}")
    for key in ("plain", "fused"):
        print(f"{key:6} {peaks[key] / 2**20:14.1f} {seconds[key]:8.3f}")
    print(f"fused: {peaks['plain'] / peaks['fused']:.1f}x less memory at the loss, "
          f"{seconds['plain'] / seconds['fused']:.2f}x the speed of plain")


LLAMA3_HEAD = {"vocab_size": 128256, "hidden_size": 4096}  # Llama-3.1-8B's output head
CHUNKS = (64, 128, 256, 512, 1024, 2048)
WORKER = Path(__file__).resolve().parent.parent / "tests" / "workers" / "head_loss_bytes.py"


def head_loss_bytes(mode, hidden, tokens, vocab, rows, seq):
    """(measured, planned) loss peak, one fresh process per measurement (tests/workers/head_loss_bytes.py)."""
    done = subprocess.run([sys.executable, str(WORKER), mode, str(hidden), str(tokens), str(vocab), str(rows), str(seq)],
                          capture_output=True, text=True, check=True)
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return r["measured"], r["planned"]


def chunk_sweep(rows=2, seq=2048):
    """The fused loss's peak per chunk size on a 128k vocabulary (a 1-layer model, hidden 64: the head's weights
    small beside the chunks), measured with LossMemory and planned, for a frozen bf16 head (LoRA) and a trained
    fp32 one under autocast; then what each chunk size costs Llama-3.1-8B's head at 2 x 2048 targets: passes over
    its 1 GiB of bf16 weights (forward, backward's recompute and grad-input: 3 a chunk), the matmuls' FLOPs per
    weight byte (= tokens per chunk: an H100's bf16 matmuls are bound by memory below ~295), and the LoRA q,v r8
    plan's total (the torchtune job of docs/memory.md)."""
    vocab = LLAMA3_HEAD["vocab_size"]
    job = ["per_device_train_batch_size=2", "max_seq_length=2048", "lora.r=8", "lora.alpha=16",
           "lora.target_modules=[q_proj,v_proj]"]
    targets, head_bytes = rows * (seq - 1), 2 * vocab * LLAMA3_HEAD["hidden_size"]
    print(f"\nthe fused loss's chunk, vocabulary {vocab}, {rows} x {seq} tokens, all targets "
          "(loss peak: measured / planned, MiB)")
    print(f"{'tokens/chunk':>12} {'LoRA head':>17} {'trained head':>17} {'chunks':>7} {'8B head reads':>14} "
          f"{'FLOP/byte':>10} {'8B LoRA plan':>13}")
    for tokens in CHUNKS:
        cells = []
        for mode in ("lora", "mixed"):
            measured, planned = head_loss_bytes(mode, 64, tokens, vocab, rows, seq)
            cells.append(f"{measured / 2**20:7.0f} / {planned / 2**20:7.0f}")
        chunks = -(-targets // tokens)
        eight_b = estimate(load_recipe("single-gpu-lora", [*job, f"loss_chunk_tokens={tokens}"]), structure(LLAMA_8B),
                           Topology(1))
        print(f"{tokens:12d} {cells[0]:>17} {cells[1]:>17} {chunks:7d} {3 * chunks * head_bytes / 2**30:10.0f} GiB "
              f"{tokens:10d} {(eight_b.total - eight_b.overhead) / 2**30:9.2f} GiB")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=7, help="timed steps per path (median)")
    parser.add_argument("--chunks", action="store_true", help="the fused loss's chunk size sweep only")
    args = parser.parse_args()
    if args.chunks:
        return chunk_sweep()
    with tempfile.TemporaryDirectory() as folder:
        compare("vocabulary 32k, 2 x 1024 tokens", *big_vocab_case(folder), args.steps)
    compare("embedded default, chat data (micro batch 4 x accumulation 4)", *embedded_case(), args.steps)


if __name__ == "__main__":
    main()
