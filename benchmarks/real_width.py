"""The plan at a real model's widths, on CPU: Llama-3.1-8B's layer (hidden 4096, intermediate 14336, 32 query and 8
key/value heads of 128; a small vocabulary, so the embedding does not dominate), one layer, on the top rung
(checkpointing, lean norms, tiled MLP; LoRA r16 on every linear, no dropout or `--dropout P`), at two lengths. For each attention
kernel, the step's allocation peak (the CPU profiler's timeline, as tests/measuring.py reads it) beside the plan's
working bytes, and the per-token slope of each: small widths hide terms that grow with the width.

    python benchmarks/real_width.py [--lengths 1024 2048]

Kernels: torch's CPU flash attention (planned as CPU: cuda=False), and flash-attn 2's and compiled flex_attention's
CUDA kernels stood in for by what they allocate (tests/standins.py; planned as a GPU: cuda=True; the stand-ins
allocate without computing, so `--kernels "flash-attn 2 stand-in" "flex_attention stand-in" "sdpa query chunks
stand-in"` takes minutes), the last sdpa's CUDA kernel in query chunks of 256 (the query chunks rung). Slow on a CPU without a bf16 GEMM: on the
2-core AVX2 machine (2026-11-28) 10 minutes gave no row yet (the CPU flash kernel's backward runs its bf16 GEMMs in a
scalar loop); run it where torch has a bf16 GEMM (torch.ops.mkldnn._is_mkldnn_bf16_supported()), or on a GPU box.
"""

import argparse
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import memrecipe  # noqa: F401  (first: quiets library notices)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the loop's own model setup

import standins  # noqa: E402
from helpers import loop_model  # noqa: E402
from measuring import step_peak  # noqa: E402
from memrecipe.planning.activations import activation_bytes, activation_mode  # noqa: E402
from memrecipe.planning.architecture import read_config, structure  # noqa: E402
from memrecipe.planning.registry import load_recipe  # noqa: E402

EIGHT_B_LAYER = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 1, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 1024, "max_position_embeddings": 131072}
TOP = ["gradient_checkpointing=true", "lean_norms=true", "tiled_mlp=true", "lora.dropout=0",
       "lora.target_modules=all-linear", "lora.r=16", "packing=false", "per_device_train_batch_size=1",
       "optimizer_in_backward=false"]
KERNELS = {"cpu flash (sdpa)": (None, "sdpa", False),
           "flash-attn 2 stand-in": ("standin_flash_attention_2", "flash_attention_2", True),
           "flex_attention stand-in": ("standin_flex_attention", "flex_attention", True),
           # sdpa's CUDA kernel in query chunks of 256 (training.query_chunks; torch's kernel: standins.TorchFlash)
           "sdpa query chunks stand-in": ("query_chunks", "sdpa", True)}
WORDS = {"query_chunks": ["attn_implementation=sdpa", "query_chunks=256"]}


def model(folder: Path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    from memrecipe.training.loading import embedded_model

    config = AutoConfig.from_pretrained(embedded_model())
    config.update(EIGHT_B_LAYER)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    return str(folder)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs=2, default=[1024, 2048])
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS),
                        help="the stand-ins alone run in a few minutes here (they allocate, not compute)")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="LoRA's dropout (as shipped: 0.05), drawn as CUDA's fused kernel allocates")
    args = parser.parse_args()
    if args.dropout:  # CUDA's dropout and random states, as the stand-in kernels' rows are planned (cuda=True)
        torch.nn.functional.dropout = standins.cuda_dropout
        standins.use_cuda_random_states(SimpleNamespace(setattr=setattr))
    path = model(Path(tempfile.mkdtemp(prefix="memrecipe-real-width-")))
    s = structure(read_config(path))
    print("| kernel | tokens | measured peak MiB | planned MiB | planned / measured | slope measured B/token | "
          "slope planned B/token | slope ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.kernels:
        standin, kernel, cuda = KERNELS[name]
        peaks, plans = {}, {}
        for length in args.lengths:
            r = load_recipe("single-gpu-lora", [*TOP, *WORDS.get(standin or "", []), f"max_seq_length={length}",
                                                f"lora.dropout={args.dropout}"])
            m, _ = loop_model(r, path, "bf16")
            if standin == "query_chunks":
                standins.use_torch_flash(SimpleNamespace(setattr=setattr))
            elif standin:
                standins.use(m, standin)
            m.train()
            ids = torch.randint(0, s.vocab, (1, length), generator=torch.Generator().manual_seed(0))
            batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids),
                     "position_ids": torch.arange(length)[None]}
            peaks[length] = step_peak(m, batch, autocast=True)
            plans[length] = activation_bytes(r, s, activation_mode(r, 2), 1, length, attention=kernel,
                                             cuda=cuda)["working"]
            del m
        short, long = args.lengths
        slope = (peaks[long] - peaks[short]) / (long - short)
        planned = (plans[long] - plans[short]) / (long - short)
        for length in args.lengths:
            print(f"| {name} | {length:,} | {peaks[length] / 2**20:,.1f} | {plans[length] / 2**20:,.1f} | "
                  f"{plans[length] / peaks[length]:.3f} | {slope:,.0f} | {planned:,.0f} | {planned / slope:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
