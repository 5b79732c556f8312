"""The activation ladder's price, in one process on CPU: for each rung (no checkpointing, selective, full, full with
the inputs offloaded, full with lean norms, with the MLP tiled too, and with sdpa's attention in query chunks), at
doubling lengths, the bytes a training
step's forward leaves held for backward (the CPU profiler) beside the planner's count, and the tokens per second of a
forward and backward. Ratios are against full checkpointing, measured in the same script on the same batches.

    python benchmarks/long_context.py [--lengths 1024 2048 4096] [--steps 3]
    python benchmarks/long_context.py --price 8192 16384 [--repeats 3]   (each rung's step time only)
    python benchmarks/long_context.py --redraw 256 2048 [--repeats 5]   (LoRA's dropout redrawn vs peft's, and the
                                                                          peers' setup: step time, and the torch ops
                                                                          a step dispatches, a GPU's kernel launches)

The model is the embedded Llama's shape widened so that per-token costs dominate (hidden 512, intermediate 1536,
4 layers), trained by single-gpu-lora's model code (LoRA on every linear, bf16 autocast), micro batch 1.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import memrecipe  # noqa: F401  (first: quiets library notices)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the loop's own model setup

from helpers import loop_model  # noqa: E402
from measuring import held_after_forward, ops_counted, profiled_peak, step_peak  # noqa: E402
from memrecipe.training.loss import lm_loss  # noqa: E402
from memrecipe.planning.activations import activation_bytes, activation_mode  # noqa: E402
from memrecipe.planning.architecture import read_config, structure  # noqa: E402
from memrecipe.planning.registry import load_recipe  # noqa: E402

RUNGS = {"none": ["gradient_checkpointing=false"], "selective": ["gradient_checkpointing=selective"],
         "full": ["gradient_checkpointing=true"], "offload": ["gradient_checkpointing=true", "activation_offload=true"],
         "lean": ["gradient_checkpointing=true", "lean_norms=true"],
         "tiled": ["gradient_checkpointing=true", "lean_norms=true", "tiled_mlp=true"],
         # sdpa's kernel in query chunks of 2,048 (the query chunks rung; on CPU each chunk's forward under a dense mask)
         "chunks": ["gradient_checkpointing=true", "lean_norms=true", "tiled_mlp=true", "attn_implementation=sdpa",
                    "packing=false", "query_chunks=2048"]}
WIDE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 64}


def wide_model(folder: Path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from memrecipe.training.loading import embedded_model

    config = AutoConfig.from_pretrained(embedded_model())
    config.update(WIDE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(embedded_model()).save_pretrained(folder)
    return str(folder)


def step(model, batch) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(model, batch)
    loss.backward()


def measure(model_path: str, rung: str, length: int, steps: int) -> dict:
    recipe = load_recipe("single-gpu-lora", [*RUNGS[rung], f"max_seq_length={length}", "per_device_train_batch_size=1",
                                             "lora.target_modules=all-linear", "packing=false"])  # one document a row
    model, _ = loop_model(recipe, model_path, "bf16")
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids),
             "position_ids": torch.arange(length)[None]}
    _, held, _ = held_after_forward(model, batch, autocast=True)
    model.zero_grad(set_to_none=True)
    peak = step_peak(model, batch, autocast=True)  # beside the weights and their gradients
    seconds = []
    for _ in range(steps):  # (no profiler on: its bookkeeping would be timed too)
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step(model, batch)
        seconds.append(time.perf_counter() - start)
    s = structure(read_config(model_path))
    planned = activation_bytes(recipe, s, activation_mode(recipe, 2), 1, length)
    return {"held": held, "planned": planned["forward_saved"], "host": planned["host"], "peak": peak,
            "working": planned["working"], "tokens_per_second": length / statistics.median(seconds)}


def library_peak(model_path: str, length: int, library: str) -> int:
    """The step peak (beside the weights and gradients) of a library trainer's own training_step on the same model
    and row: transformers' Trainer (gradient checkpointing, peft's LoRA on every linear, dropout 0.05, bf16), TRL's
    SFTTrainer (its default loss). (TRL's activation_offloading needs an accelerator: its OffloadActivations reads
    torch.accelerator.current_accelerator(), None on CPU.)"""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, use_kernels=False)  # (the loop's)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    ids = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    with tempfile.TemporaryDirectory() as out:
        common = {"output_dir": out, "per_device_train_batch_size": 1, "gradient_checkpointing": True,
                  "gradient_checkpointing_kwargs": {"use_reentrant": False}, "bf16": True, "use_cpu": True,
                  "report_to": []}
        if library == "Trainer":
            trainer = Trainer(model=model, args=TrainingArguments(**common))
            inputs = {"input_ids": torch.tensor([ids]), "labels": torch.tensor([ids]),
                      "attention_mask": torch.ones(1, length, dtype=torch.long)}
        else:
            from datasets import Dataset
            from trl import SFTConfig, SFTTrainer

            trainer = SFTTrainer(model=model, args=SFTConfig(**common, max_length=length, packing=False),
                                 train_dataset=Dataset.from_dict({"input_ids": [ids]}),
                                 processing_class=AutoTokenizer.from_pretrained(model_path))
            inputs = trainer.data_collator([{"input_ids": ids}])
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as train() does
        prepared = trainer.accelerator.prepare_model(trainer.model)
        trainer.current_gradient_accumulation_steps = 1  # (what train() sets before its first step)
        prepared.train()
        trainer.training_step(prepared, inputs)  # (warm: the first step's one-time allocations)
        prepared.zero_grad(set_to_none=True)
        return profiled_peak(lambda: trainer.training_step(prepared, inputs))


def peft_and_transformers(model_path: str):
    """The peers' model setup (benchmarks/peers.py): peft's LoRA as single-gpu-lora ships it (r 16, alpha 32, dropout
    0.05, every linear) on a bf16 base, transformers' own non-reentrant checkpointing, no memrecipe code."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    # (use_kernels=False, as the loop loads: transformers 5.25 would swap in hub kernels on a GPU)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, use_kernels=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                                            task_type="CAUSAL_LM"))


# LoRA's dropout redrawn in backward (what `lora.redraw_dropout: auto` takes where only the redraw fits) against
# peft's own (--redraw; what auto takes where it fits), under full checkpointing, and the peers' setup beside them
DROPOUTS = {"redrawn": ["gradient_checkpointing=true", "lora.redraw_dropout=true"],
            "peft's": ["gradient_checkpointing=true", "lora.redraw_dropout=false"],
            "peers'": peft_and_transformers}


def ops_dispatched(model, batch) -> int:
    """The torch ops one step dispatches: on a GPU each is a kernel launch (or more), the host's work in a
    launch-bound step, whatever the CPU's compute costs."""
    model.zero_grad(set_to_none=True)
    return ops_counted(lambda: step(model, batch))


def price(model_path: str, length: int, repeats: int, rungs: dict = RUNGS, base: str = "full",
          count: bool = False) -> dict:
    """Each rung's median step time over `repeats` rounds, the rungs interleaved within each round (one model each,
    built first, one warm-up step), so that the machine's drift over the minutes this takes falls on every rung
    alike; ratios to `base`'s; with `count`, the ops its step dispatches (ops_dispatched) beside them."""
    batch = None
    models = {}
    for rung in rungs:
        if callable(rungs[rung]):  # (a model built without memrecipe: the peers')
            models[rung] = rungs[rung](model_path)
        else:
            recipe = load_recipe("single-gpu-lora", [*rungs[rung], f"max_seq_length={length}",
                                                     "per_device_train_batch_size=1", "lora.target_modules=all-linear",
                                                     "packing=false"])
            models[rung], _ = loop_model(recipe, model_path, "bf16")
        models[rung].train()
        ids = torch.randint(0, models[rung].config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids),
                 "position_ids": torch.arange(length)[None]}
        step(models[rung], batch)  # warm-up
    seconds = {rung: [] for rung in rungs}
    for _ in range(repeats):
        for rung, model in models.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step(model, batch)
            seconds[rung].append(time.perf_counter() - start)
    medians = {rung: statistics.median(times) for rung, times in seconds.items()}
    ops = {rung: ops_dispatched(model, batch) if count else None for rung, model in models.items()}
    return {rung: (median, median / medians[base], ops[rung]) for rung, median in medians.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--libraries", action="store_true", help="also the step peak of transformers' Trainer and "
                        "TRL's SFTTrainer at each length, and each one's longest length under --budget-mib")
    parser.add_argument("--budget-mib", type=float, default=1024, help="the activation budget the longest lengths are "
                        "read at: extrapolated along each trainer's measured peaks (first to last length)")
    parser.add_argument("--price", type=int, nargs="*", metavar="LENGTH", help="only each rung's step time against "
                        "full checkpointing's at these lengths (e.g. 8192 16384), the rungs interleaved")
    parser.add_argument("--redraw", type=int, nargs="*", metavar="LENGTH", help="only the step time of LoRA's "
                        "dropout redrawn in backward against peft's own and against peft with transformers' "
                        "checkpointing (the peers' setup), at these lengths, interleaved")
    parser.add_argument("--repeats", type=int, default=3, help="--price's and --redraw's rounds (the median is read)")
    args = parser.parse_args()
    if args.libraries and len(set(args.lengths)) < 2:
        parser.error("--libraries reads each trainer's longest length along its peaks: give two --lengths or more")
    if args.price or args.redraw:
        rungs, base = (RUNGS, "full") if args.price else (DROPOUTS, "redrawn")
        with tempfile.TemporaryDirectory() as tmp:
            path = wide_model(Path(tmp) / "wide")
            print(f"{'length':>7} {'rung':>10} {'step s':>8} {'x ' + base:>9}" + (f" {'ops/step':>9}" if args.redraw
                                                                              else ""))
            for length in args.price or args.redraw:
                for rung, (seconds, ratio, ops) in price(path, length, args.repeats, rungs, base,
                                                         count=bool(args.redraw)).items():
                    print(f"{length:>7} {rung:>10} {seconds:>8.2f} {ratio:>9.2f}" + (f" {ops:>9,}" if ops else ""),
                          flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = wide_model(Path(tmp) / "wide")
        print(f"{'length':>7} {'rung':>10} {'held MiB':>9} {'planned':>8} {'host':>6} {'x full':>7} {'peak':>7} "
              f"{'planned':>8} {'tok/s':>8} {'x full':>7}")
        for length in args.lengths:
            rows = {rung: measure(path, rung, length, args.steps) for rung in RUNGS}
            for rung, r in rows.items():
                full = rows["full"]
                print(f"{length:>7} {rung:>10} {r['held'] / 2**20:>9.1f} {r['planned'] / 2**20:>8.1f} "
                      f"{r['host'] / 2**20:>6.1f} {r['held'] / full['held']:>7.2f} {r['peak'] / 2**20:>7.1f} "
                      f"{r['working'] / 2**20:>8.1f} {r['tokens_per_second']:>8.0f} "
                      f"{r['tokens_per_second'] / full['tokens_per_second']:>7.2f}")
    if args.libraries:
        with tempfile.TemporaryDirectory() as tmp:
            path = wide_model(Path(tmp) / "wide")
            print(f"\n{'length':>7} {'trainer':>22} {'step peak MiB':>14} {'x memrecipe full':>17}")
            peaks = {}
            for length in args.lengths:
                ours = peaks.setdefault("memrecipe full", {})[length] = measure(path, "full", length, 1)["peak"]
                peaks.setdefault("memrecipe tiled", {})[length] = measure(path, "tiled", length, 1)["peak"]
                for library in ("Trainer", "TRL SFTTrainer"):
                    peak = peaks.setdefault(library, {})[length] = library_peak(path, length, library)
                    print(f"{length:>7} {library:>22} {peak / 2**20:>14.1f} {peak / ours:>17.2f}", flush=True)
            budget = args.budget_mib * 2**20
            print(f"\nthe longest length under {args.budget_mib:.0f} MiB of step peak, along each one's measured "
                  f"peaks from {args.lengths[0]} to {args.lengths[-1]} tokens:")
            for name, at in peaks.items():
                first, last = args.lengths[0], args.lengths[-1]
                per_token = (at[last] - at[first]) / (last - first)
                print(f"{name:>22} {first + (budget - at[first]) / per_token:>10,.0f} tokens "
                      f"({per_token / 1024:.1f} KiB a token)")
    print("MiB. held: what the forward leaves for backward (the CPU profiler; offload's host copies included: on CPU the "
          "host is the device); planned: the planner's bytes on the device after the forward, host: in host RAM; "
          "peak: the most held at once over the step beside the weights and their gradients (the profiler's memory "
          "timeline), planned: the plan's working activations")


if __name__ == "__main__":
    main()
