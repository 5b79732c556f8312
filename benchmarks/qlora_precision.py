"""QLoRA with its unquantized weights in bf16 (memrecipe's default) against PEFT's fp32 upcast
(`quantization.upcast_unquantized=true`): the same recipe, seed and batches, on CPU.

    python benchmarks/qlora_precision.py [--steps 60] [--runs 2]

Each variant is trained by `memrecipe run` (the real loop) on the embedded model and data; the
table gives the loss along the way, the final eval loss, the bytes the model states hold, and the
time per step. Runs alternate between the variants; losses are from the first run of each (the
runs are deterministic), times are medians.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

from runs import memrecipe_run

VARIANTS = {"bf16 (default)": "quantization.upcast_unquantized=false",
            "fp32 upcast (PEFT)": "quantization.upcast_unquantized=true"}


def run(folder: Path, override: str, steps: int) -> dict:
    return memrecipe_run(folder, "qlora", override, f"max_steps={steps}", "eval_steps=null", "logging_steps=1000",
                         "seed=7")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", type=int, default=2, help="runs per variant (for the time per step)")
    args = parser.parse_args()
    reports, seconds = {}, {k: [] for k in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for name, override in VARIANTS.items():
                r = run(Path(tmp) / f"{i}-{len(reports)}-{name[:4]}", override, args.steps)
                reports.setdefault(name, r)
                seconds[name].append(r["throughput"]["seconds_per_step"])
    marks = sorted({1, *range(10, args.steps + 1, max(1, args.steps // 6)), args.steps})
    print(f"QLoRA on the embedded model, {args.steps} steps, seed 7 (loss per target token)")
    print(f"{'variant':20} " + " ".join(f"{'step ' + str(m):>9}" for m in marks)
          + f" {'eval':>7} {'params MiB':>10} {'s/step':>7}")
    for name, r in reports.items():
        loss = {h["step"]: h["loss"] for h in r["history"]}
        held = r["processes"][0]["held"]["parameters"] / 2**20
        print(f"{name:20} " + " ".join(f"{loss[m]:9.4f}" for m in marks)
              + f" {r['final_eval_loss']:7.4f} {held:10.2f} {statistics.median(seconds[name]):7.3f}")


if __name__ == "__main__":
    main()
