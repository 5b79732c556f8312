"""memrecipe's LoRA run beside transformers' Trainer and TRL's SFTTrainer on the same rows, on CPU: the embedded
model, full rows of 256 random tokens (every position a target, no padding: what benchmarks/peers.py trains the
peers on), micro batch 4 x accumulation 4, bf16, gradient checkpointing, LoRA r 16 on every linear with dropout 0.05.
memrecipe runs through `memrecipe run sft --recipe single-gpu-lora` as shipped (`lora.redraw_dropout: auto`, which
takes peft's dropout where the run fits with it) and with the redraw forced (`lora.redraw_dropout=true`). Each
one's tokens a second after its first step, the runs interleaved round by round, the median and its ratio to
Trainer's (docs/speed.md).

    python benchmarks/beside_peers.py [--rounds 3] [--steps 12]     # ~1 minute a round on 2 cores
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from runs import memrecipe_run

HERE = Path(__file__).resolve().parent
SEQ, MICRO, ACCUMULATION = 256, 4, 4


def random_rows(folder: Path, tokenizer_path: str, rows: int) -> Path:
    """A text dataset whose every row fills max_seq_length tokens: random token ids, decoded."""
    from transformers import AutoTokenizer

    tokenizer, rng = AutoTokenizer.from_pretrained(tokenizer_path), random.Random(0)
    path = folder / "random.jsonl"
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": tokenizer.decode([rng.randrange(4, tokenizer.vocab_size)
                                                          for _ in range(2 * SEQ)])}) + "\n")
    return path


def peer(library: str, model: str, steps: int, out: Path) -> float:
    cmd = [sys.executable, str(HERE / "peers.py"), "--library", library, "--method", "lora", "--model", model,
           "--seq", str(SEQ), "--micro", str(MICRO), "--accumulation", str(ACCUMULATION), "--steps", str(steps),
           "--cpu", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr[-2000:])
    return json.loads(out.read_text())["tokens_per_second"]


def ours(folder: Path, data: Path, steps: int, *words: str) -> float:
    report = memrecipe_run(folder, "single-gpu-lora", "--cpu", "--dataset", str(data), f"max_steps={steps}",
                           "eval_size=0", "eval_steps=null", f"max_seq_length={SEQ}",
                           f"per_device_train_batch_size={MICRO}", f"gradient_accumulation_steps={ACCUMULATION}",
                           *words)
    assert report["throughput"]["padding_fraction"] == 0, "rows not full: the speeds would not compare"
    return report["throughput"]["tokens_per_second"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    from memrecipe.training.loading import embedded_model

    model = embedded_model()
    speeds: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        data = random_rows(base, model, rows=MICRO * ACCUMULATION * (args.steps + 2))
        runs = {"transformers Trainer + peft": lambda i: peer("trainer", model, args.steps, base / f"trainer-{i}.json"),
                "TRL SFTTrainer": lambda i: peer("trl", model, args.steps, base / f"trl-{i}.json"),
                "memrecipe, as shipped (peft's dropout: auto)": lambda i: ours(base / f"auto-{i}", data, args.steps),
                "memrecipe, lora.redraw_dropout=true": lambda i: ours(base / f"redraw-{i}", data, args.steps,
                                                                      "lora.redraw_dropout=true")}
        for i in range(args.rounds):
            for name, run in runs.items():
                speeds.setdefault(name, []).append(run(i))
                print(f"round {i + 1}/{args.rounds}: {name}: {speeds[name][-1]:,.0f} tokens/s", file=sys.stderr)
    base_speed = statistics.median(speeds["transformers Trainer + peft"])
    print(f"tokens/s after the first step, median of {args.rounds} interleaved rounds (x Trainer's); the embedded model, "
          f"{MICRO} x {SEQ} tokens x accumulation {ACCUMULATION}, {args.steps} steps, 2 CPU cores\n")
    print("| run | tokens/s | x Trainer | every round |\n|---|---|---|---|")
    for name, values in speeds.items():
        median = statistics.median(values)
        print(f"| {name} | {median:,.0f} | {median / base_speed:.2f} | {', '.join(f'{v:,.0f}' for v in values)} |")


if __name__ == "__main__":
    main()
