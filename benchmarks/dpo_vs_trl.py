"""Preference tuning, one optimizer step at a time: memrecipe's (pairs packed as documents, the fused head, the
reference beside each step or precomputed) against TRL's DPOTrainer (its padded [chosen; rejected] batch, its own
fused head) on the same model, pairs and settings, in one process on CPU.

    python benchmarks/dpo_vs_trl.py [--pairs 16] [--warmup 3] [--blocks 5] [--steps 2]

Per setting (LoRA r 16 on every linear layer with the reference = adapters off; a full fine-tune with the
reference's log-probs precomputed, as both tools do it), each step: the same `--pairs` pairs of the embedded
preference set, AdamW, bf16 autocast, gradient checkpointing, beta 0.1, sigmoid loss. Measured: real (non-padding)
tokens per second (forward, backward, optimizer step; for LoRA the reference's forward too) over blocks of `--steps`
steps, ours and TRL's blocks interleaved, `--blocks` of each, after `--warmup` steps each; the ratio is taken block
pair by block pair (so a machine that slows down slows both), min / median / max. And the bytes a step allocates at
its peak above what is held before it (the CPU profiler's allocation events: not RSS), from one profiled step each,
after the timing. On CPU the speed says little about a GPU's; the bytes carry.

Why the warm-up and the blocks (the old 3 single steps after one warm-up gave LoRA 3.11x, 0.83x and 1.24x in three
runs): the first steps of each tool meet their shapes for the first time (oneDNN builds and caches a kernel per
shape and bf16 layout; TRL's padded batch and ours differ, so each pays it on its own first steps), and a single
step on 2 shared cores takes whatever else the machine does in that second. Interleaved multi-step blocks after a
warm-up that has met every shape, and the ratio per block pair, repeat within ~10% run to run.
"""

import argparse
import copy
import gc
import json
import statistics
import tempfile
import time

import memrecipe  # noqa: F401  (first: quiets library notices)
import torch

from memrecipe.planning.recipe import Dpo
from memrecipe.planning.registry import EMBEDDED_PREFERENCES
from memrecipe.training.loss import fuse_head
from memrecipe.training.probes import allocation_peak
from memrecipe.training.loading import embedded_model
from memrecipe.training.tokenizer import load_tokenizer
from memrecipe.training.preference import (PairCollator, pack_pairs, preference_sums, reference_store,
                                           sequence_logps, tokenize_pair, window_loss)

MODEL = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 1024,
         "tie_word_embeddings": False}  # ~55M parameters: a vocabulary large enough for the logits to matter


def build(lora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**MODEL), attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if lora:
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    return model


class Ours:
    def __init__(self, model, pairs, tokenizer, lora):
        from datasets import Dataset

        self.model, self.lora, self.dpo = model, lora, Dpo()
        fuse_head(model)
        tokenized = [tokenize_pair(p, tokenizer, 512) for p in pairs]
        rows = pack_pairs(Dataset.from_list(tokenized), 1024)
        self.batch = PairCollator(tokenizer.pad_token_id)(list(rows))
        self.tokens = int(self.batch["attention_mask"].sum())
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        self.store = None
        if not lora:  # precomputed, once, outside the steps (as the loop does before step 1)
            from types import SimpleNamespace

            one = SimpleNamespace(prepare_data_loader=lambda d: d, pad_across_processes=lambda t, **k: t,
                                  gather=lambda t: t)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                self.store = reference_store(model, [rows], PairCollator(tokenizer.pad_token_id), one, len(rows))

    def step(self):
        b = self.batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if self.store is not None:
                reference = self.store[b["index"]].flatten()
            else:
                with torch.no_grad(), self.model.disable_adapter():
                    reference = sequence_logps(self.model, b)
            sums = preference_sums(sequence_logps(self.model, b), reference, b, self.dpo)
            loss = window_loss(sums, sums["pairs"], 0)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)


class Trl:
    def __init__(self, model, pairs, tokenizer, lora, folder):
        import trl
        from datasets import Dataset

        args = trl.DPOConfig(output_dir=folder, report_to="none", max_length=512, per_device_train_batch_size=len(pairs),
                             use_cpu=True, bf16=True, beta=0.1, precompute_ref_log_probs=not lora,
                             gradient_checkpointing=True, learning_rate=1e-5)
        self.trainer = trl.DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs),
                                      processing_class=tokenizer)
        self.batch = self.trainer.data_collator([self.trainer.train_dataset[i] for i in range(len(pairs))])
        self.tokens = int(self.batch["attention_mask"].sum())
        self.model = self.trainer.model
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-5)

    def step(self):
        self.model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = self.trainer.compute_loss(self.model, self.batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)


def timed(runner, steps: int) -> float:
    """Real tokens per second over `steps` steps."""
    gc.collect()
    tick = time.perf_counter()
    for _ in range(steps):
        runner.step()
    return runner.tokens * steps / (time.perf_counter() - tick)


def spread(values, digits: int = 0) -> str:
    return " / ".join(f"{v:,.{digits}f}" for v in (min(values), statistics.median(values), max(values)))


def peak(runner) -> int:
    gc.collect()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        runner.step()
    return allocation_peak(profile)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=16, help="pairs per step")
    parser.add_argument("--warmup", type=int, default=3, help="steps each before timing (every shape met)")
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks of each, interleaved")
    parser.add_argument("--steps", type=int, default=2, help="steps per timed block")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())  # (fixed for the whole run)
    tokenizer = load_tokenizer(embedded_model())
    pairs = [json.loads(line) for line in open(EMBEDDED_PREFERENCES)][:args.pairs]
    rows = []
    for name, lora in (("LoRA r16, reference = adapters off", True), ("full fine-tune, reference precomputed", False)):
        with tempfile.TemporaryDirectory() as folder:
            ours, theirs = Ours(build(lora), pairs, tokenizer, lora), Trl(build(lora), copy.deepcopy(pairs), tokenizer,
                                                                          lora, folder)
            for runner in (ours, theirs):
                for _ in range(args.warmup):
                    runner.step()
            speeds = {"ours": [], "trl": []}
            for _ in range(args.blocks):  # interleaved
                speeds["ours"].append(timed(ours, args.steps))
                speeds["trl"].append(timed(theirs, args.steps))
            ratios = [a / b for a, b in zip(speeds["ours"], speeds["trl"])]
            bytes_ = {"ours": peak(ours), "trl": peak(theirs)}
            rows.append((name, ours.tokens, theirs.tokens, speeds, ratios, bytes_))
    print(f"{args.pairs} pairs a step, ~55M-parameter Llama (vocab 32000), bf16 autocast, checkpointing, CPU, "
          f"{torch.get_num_threads()} threads; {args.blocks} interleaved blocks of {args.steps} steps after "
          f"{args.warmup} warm-up steps each; min / median / max\n")
    print("| setting | real tokens (ours / TRL's batch) | tokens/s ours | tokens/s TRL | ratio (per block pair) | "
          "step's peak MiB ours | TRL | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name, ours_tokens, trl_tokens, speeds, ratios, b in rows:
        print(f"| {name} | {ours_tokens:,} / {trl_tokens:,} | {spread(speeds['ours'])} | {spread(speeds['trl'])} | "
              f"{spread(ratios, 2)} | {b['ours'] / 2**20:,.1f} | {b['trl'] / 2**20:,.1f} | {b['ours'] / b['trl']:.2f} |")


if __name__ == "__main__":
    main()
