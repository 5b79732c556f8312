"""A peer's training run on the same shape as a memrecipe row, in a process of its own (so that its allocator peak is
its own): transformers' Trainer with peft's LoRA (r 16, alpha 32, dropout 0.05, every linear layer, a bf16 base) or a
full fine-tune of fp32 weights with bitsandbytes' 8-bit AdamW, or TRL's SFTTrainer with the same LoRA (its default
loss; padding_free where the kernel is a varlen one). bf16, gradient checkpointing (non-reentrant), the attention
kernel, micro batch, accumulation and length given; rows of random tokens, every position a target (no padding). It
writes the tokens a second after the first step and the CUDA allocator's peak as JSON. gpu_acceptance.py runs it
beside the rows it has peers for.

    python benchmarks/peers.py --library trainer --method lora --model PATH --seq 2048 --micro 4 --accumulation 4 \\
        --steps 6 --attention sdpa --out peer.json [--cpu]
"""

import argparse
import json
import tempfile
import time
from pathlib import Path


VARLEN = ("flash_attention_2", "flash_attention_3")


def rows_of(n: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--library", choices=("trainer", "trl"), required=True)
    parser.add_argument("--method", choices=("lora", "full-8bit"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--micro", type=int, required=True)
    parser.add_argument("--accumulation", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    cuda = torch.cuda.is_available() and not args.cpu
    lora = args.method == "lora"
    # as memrecipe trains them: a LoRA base in bf16 (fp32 adapters), adamw-8bit's fp32 weights under bf16 autocast;
    # its kernels (use_kernels=False, as the loop loads: transformers 5.25 would swap in hub kernels on a GPU)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if lora else torch.float32,
                                                 attn_implementation=args.attention, use_kernels=False)
    from peft import LoraConfig

    adapters = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    tokens = rows_of(args.micro * args.accumulation * args.steps, args.seq, model.config.vocab_size)
    seconds = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        common = {"output_dir": out, "per_device_train_batch_size": args.micro,
                  "gradient_accumulation_steps": args.accumulation, "max_steps": args.steps, "bf16": True,
                  "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False},
                  "learning_rate": 2e-4 if lora else 1e-5, "logging_steps": 1, "report_to": [], "save_strategy": "no",
                  "use_cpu": not cuda, "optim": "adamw_torch" if lora else "adamw_bnb_8bit", "seed": 42}
        if args.library == "trainer":
            from peft import get_peft_model
            from transformers import Trainer, TrainingArguments, default_data_collator

            trainer = Trainer(model=get_peft_model(model, adapters) if lora else model,
                              args=TrainingArguments(**common), callbacks=[Clock()],
                              train_dataset=Dataset.from_dict({"input_ids": tokens, "labels": tokens}),
                              data_collator=default_data_collator)
        else:
            from trl import SFTConfig, SFTTrainer

            # padding_free flattens a micro batch into one row that only a varlen kernel keeps apart (TRL's own
            # warning); the rows here are full, so without one it has no padding to free and stays off
            trainer = SFTTrainer(model=model, args=SFTConfig(**common, max_length=None, packing=False,  # (rows cut)
                                                             padding_free=args.attention in VARLEN),
                                 train_dataset=Dataset.from_dict({"input_ids": tokens}), callbacks=[Clock()],
                                 processing_class=AutoTokenizer.from_pretrained(args.model),
                                 peft_config=adapters if lora else None)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    timed = seconds[-1] - seconds[0]  # after the first step, as memrecipe's report reads its speed
    per_step = args.micro * args.accumulation * args.seq
    result = {"library": args.library, "method": args.method, "steps": len(seconds), "attention": args.attention,
              "tokens_per_second": per_step * (len(seconds) - 1) / timed if len(seconds) > 1 and timed > 0 else None,
              "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
              "final_loss": next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), None)}
    args.out.write_text(json.dumps(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
