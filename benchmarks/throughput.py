"""Real (non-padding) tokens per second: memrecipe packed, memrecipe unpacked, and transformers' Trainer
on the same model, data and settings, on CPU.

    python benchmarks/throughput.py [--steps 30] [--repeats 3]

The fixture is built here: a random-init Llama of ~20M parameters (hidden 512, intermediate 1376, 4
layers, 8 heads / 4 kv heads, vocab 8000, untied), a BPE tokenizer trained on the generated text, and
2000 prompt/completion examples of lognormal length (median ~100 tokens, a few over 256), so that
about half of a padded batch is padding. Two settings, micro batch 4 x accumulation 4, max_seq_length
256: LoRA (r 16 on every linear layer) + gradient checkpointing + bf16 autocast + AdamW, and a full
fine-tune + gradient checkpointing + bf16 autocast + bitsandbytes 8-bit AdamW. memrecipe runs through
`memrecipe run` (the real loop; its report's tokens/s counts real tokens over the loop's wall time; with
torch_compile, over the steps after the first, which compiles, and the compile time is printed);
Trainer runs in a process of its own, its real tokens counted in its collator over train_runtime.
The runs interleave (A B C A B C ...) and the table gives medians and each one's ratio to Trainer.
"""

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from runs import memrecipe_run

SETTINGS = {"LoRA + checkpointing + bf16": "single-gpu-lora",
            "full fine-tune + 8-bit AdamW": "adamw-8bit"}
WORDS = ("the of and to in is was for on that with as by at from his her an which were are this be had not "
         "model data train loss step memory batch token layer weight river stone cloud light table music ocean "
         "paper bread chair dream earth flame grape honey north south city music number value answer question").split()


def make_fixture(folder: Path, examples: int = 2000) -> tuple[Path, Path]:
    """(model folder, data.jsonl): the ~20M Llama with a locally trained tokenizer, and the examples."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)

    def sentence(n_words):
        return " ".join(rng.choice(WORDS) + (str(rng.randrange(100)) if rng.random() < 0.1 else "")
                        for _ in range(n_words))

    rows = []
    for _ in range(examples):
        words = max(8, int(rng.lognormvariate(math.log(90), 0.5)))  # ~1.1 tokens a word: median ~100 tokens
        cut = max(2, int(words * rng.uniform(0.2, 0.5)))
        rows.append({"prompt": sentence(cut) + "?", "completion": " " + sentence(words - cut) + "."})
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((r["prompt"] + r["completion"] for r in rows), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    model_dir = folder / "model"
    config = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    return model_dir, data


TRAINER = r'''
import json, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
from memrecipe.training.data import Collator, load_any, tokenize
from memrecipe.planning.registry import load_recipe

model_dir, data, recipe_name, steps, out = sys.argv[1:6]
recipe = load_recipe(recipe_name)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
ds = load_any(data).map(tokenize, fn_kwargs={"tokenizer": tokenizer, "fmt": "prompt_completion",
                                              "max_seq_length": recipe.max_seq_length}, remove_columns=["prompt", "completion"])
ds = ds.remove_columns("cut")
lora = recipe.lora is not None
# (use_kernels=False, as the loop loads: transformers 5.25 would swap in hub kernels on a GPU)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if lora else torch.float32, use_kernels=False)
if lora:
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(model, LoraConfig(r=recipe.lora.r, lora_alpha=recipe.lora.alpha, lora_dropout=recipe.lora.dropout,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
pad = Collator(tokenizer.pad_token_id)
real = [0]
def collate(examples):
    batch = pad(examples)
    real[0] += int(batch["attention_mask"].sum())
    return batch
args = TrainingArguments(output_dir=out, per_device_train_batch_size=recipe.per_device_train_batch_size,
                         gradient_accumulation_steps=recipe.gradient_accumulation_steps, max_steps=int(steps),
                         learning_rate=recipe.learning_rate, lr_scheduler_type="cosine",
                         warmup_steps=-(-int(steps) * 5 // 100),  # memrecipe: ceil(warmup_ratio 0.05 x steps)
                         bf16=True, use_cpu=True, gradient_checkpointing=True,
                         gradient_checkpointing_kwargs={"use_reentrant": False},
                         optim="adamw_bnb_8bit" if recipe.uses_bnb else "adamw_torch", max_grad_norm=1.0,
                         logging_steps=1000, save_strategy="no", report_to="none", seed=7,
                         remove_unused_columns=False, disable_tqdm=True, dataloader_num_workers=0)
result = Trainer(model=model, args=args, train_dataset=ds, data_collator=collate).train()
print(json.dumps({"tokens_per_second": real[0] / result.metrics["train_runtime"]}))
'''


def trainer_run(model_dir: Path, data: Path, recipe: str, steps: int, out: Path) -> float:
    done = subprocess.run([sys.executable, "-c", TRAINER, str(model_dir), str(data), recipe, str(steps), str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_second"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    speeds: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = make_fixture(Path(tmp))
        common = ["--cpu", "--model", str(model_dir), "--dataset", str(data), f"max_steps={args.steps}",
                  "eval_size=0", "eval_steps=null", "logging_steps=1000", "seed=7", "max_seq_length=256"]
        for i in range(args.repeats):
            for setting, recipe in SETTINGS.items():
                one = ["--num-processes", "1"] if recipe == "adamw-8bit" else []
                mine = lambda name, *words: memrecipe_run(Path(tmp) / f"{name}-{recipe}-{i}", recipe, *common, *words, *one)  # noqa: E731
                runs = {"transformers Trainer": lambda: trainer_run(model_dir, data, recipe, args.steps,
                                                                   Path(tmp) / f"trainer{i}"),
                        "memrecipe, packing: false": lambda: speed(mine("unpacked", "packing=false")),
                        "memrecipe, packing: true": lambda: speed(mine("packed", "packing=true")),
                        COMPILED: lambda: speed(mine("compiled", "packing=true", "torch_compile=true"), after_first=True)}
                for name, run in runs.items():
                    speeds.setdefault((setting, name), []).append(run())
                    print(f"run {i + 1}/{args.repeats}: {setting}, {name}: {speeds[(setting, name)][-1]:,.0f} real tokens/s",
                          file=sys.stderr)
    print(f"Real tokens/s on 2 CPU cores, median of {args.repeats} (ratio to Trainer); micro batch 4 x accumulation 4, "
          f"max_seq_length 256, {args.steps} steps")
    print(f"| | {' | '.join(SETTINGS)} |\n|---|{'---|' * len(SETTINGS)}")
    for name in ("transformers Trainer", "memrecipe, packing: false", "memrecipe, packing: true", COMPILED):
        cells = []
        for setting in SETTINGS:
            median, base = statistics.median(speeds[(setting, name)]), statistics.median(speeds[(setting, "transformers Trainer")])
            cells.append(f"{median:,.0f} ({median / base:.2f}x)")
        print(f"| {name} | {' | '.join(cells)} |")
    print(f"\n(torch_compile row: tokens/s after the first step; the first step, compiling included, took "
          f"{min(first_steps):.0f}-{max(first_steps):.0f} s)")


COMPILED = "memrecipe, packing: true, torch_compile: true (after the first step)"
first_steps: list[float] = []  # seconds of each compiled run's first step


def speed(report: dict, after_first: bool = False) -> float:
    """Real tokens/s of a memrecipe run: over the loop's wall time, or over the steps after the first
    (a compiled run's first step compiles)."""
    if not after_first:
        return report["throughput"]["tokens_per_second_overall"]  # first step included, as Trainer's train_runtime
    history = report["history"]
    first_steps.append(history[0]["seconds"])
    return sum(h["tokens"] for h in history[1:]) / sum(h["seconds"] for h in history[1:])


if __name__ == "__main__":
    main()
