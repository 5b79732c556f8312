"""Do bf16 weights with no fp32 master copy still learn? The single-gpu-full recipe against itself with
fp32 master weights, and with plain (round-to-nearest) bf16 updates, on CPU.

    python benchmarks/bf16_rounding.py [--steps 300] [--lr 2e-5]

The regime is chosen where rounding matters: a ~19M-parameter Llama initialised with std 0.02 and
trained at learning rate 2e-5, so that a typical Adam update (~lr) is below half a bf16 step of a
typical weight (0.02 has a bf16 spacing of 2^-13 = 1.2e-4). Every variant is trained by `memrecipe run`
(the real loop: torchao's 8-bit AdamW stepped in backward, gradient checkpointing, bf16 autocast) on
the embedded data with the same seed and batches; only the weights' dtype and the rounding differ.
The table gives the train loss (mean of the first and of the last 10 steps), how much of fp32's
decrease each variant reaches, the eval loss, and the bytes the weights and the optimizer state hold.
The two APOLLO rows (optim=apollo_adamw, rank 128) show what its low-rank state costs in learning, and
what apollo-torch's round-to-nearest update costs bf16 weights.
"""

import argparse
import sys
import tempfile
from pathlib import Path

from runs import memrecipe_run

VARIANTS = {"fp32 master weights": ["weight_dtype=fp32"],
            "bf16, stochastic rounding": ["weight_dtype=bf16", "optim_args.bf16_stochastic_round=true"],
            "bf16, round to nearest": ["weight_dtype=bf16", "optim_args.bf16_stochastic_round=false"],
            # APOLLO's low-rank state (rank 128 of 512): apollo-torch rounds bf16 updates to nearest
            "APOLLO, fp32 master weights": ["weight_dtype=fp32", "optim=apollo_adamw"],
            "APOLLO, bf16 (to nearest)": ["weight_dtype=bf16", "optim=apollo_adamw"]}


def make_model(folder: Path) -> None:
    """A ~19M Llama with the embedded tokenizer, initialised with std 0.02, saved like a hub model."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from memrecipe.planning.registry import EMBEDDED_MODEL

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                         initializer_range=0.02, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def run(model: Path, folder: Path, overrides: list[str], steps: int, lr: float) -> dict:
    return memrecipe_run(folder, "single-gpu-full", "--cpu", "--model", str(model), *overrides, f"max_steps={steps}",
                         f"learning_rate={lr}", "lr_scheduler_type=constant", "warmup_ratio=0", "eval_steps=null",
                         "logging_steps=100000", "seed=7")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=2e-5)
    args = parser.parse_args()
    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_model(model)
        for i, (name, overrides) in enumerate(VARIANTS.items()):
            reports[name] = run(model, Path(tmp) / f"run{i}", overrides, args.steps, args.lr)
            print(f"done: {name}", file=sys.stderr)

    def ends(report):
        loss = [h["loss"] for h in report["history"]]
        return sum(loss[:10]) / 10, sum(loss[-10:]) / 10

    first, last = ends(reports["fp32 master weights"])
    print(f"single-gpu-full on a 19M Llama (init std 0.02), learning rate {args.lr:g}, {args.steps} steps, seed 7")
    print(f"{'weights':28} {'loss, first 10':>14} {'loss, last 10':>13} {'of fp32 decrease':>16} {'eval':>7} "
          f"{'weights MiB':>11} {'state MiB':>9}")
    for name, r in reports.items():
        start, end = ends(r)
        share = (start - end) / (first - last)
        held = r["processes"][0]["held"]
        print(f"{name:28} {start:14.4f} {end:13.4f} {share:16.0%} {r['final_eval_loss']:7.4f} "
              f"{held['parameters'] / 2**20:11.1f} {held['optimizer_state'] / 2**20:9.1f}")
    print(f"fp32's train loss fell by {(first - last) / first:.1%}")


if __name__ == "__main__":
    main()
