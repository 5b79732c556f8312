"""The step-time forecast (planning.forecast) against what GPU runs measured: every row the leases recorded
(benchmarks/gpu_results, docs/gpu.md), its forecast tokens/s beside the measured, and the ratio. Each efficiency
constant is measured on one row (its role says which); the other rows check them. `--derive` recomputes the constants
from their rows, in order, from the forecast's own parts: what planning/forecast.py holds must be what this prints.

    python benchmarks/forecast.py            # the table (docs/speed.md)
    python benchmarks/forecast.py --derive   # each constant from its row
    python benchmarks/forecast.py --cpu      # this CPU's rates, measured; forecast vs measured steps on it

On CPU the same forecast runs at this machine's rates, measured here: a linear layer's bf16 matmuls forward and
backward (as the loop computes them: training/cpu_matmul.py where the CPU has no bf16 GEMM), causal sdpa, a LoRA
adapter's time beyond its base layer against the bytes the forecast counts for it, and a copy's bandwidth. Then
single-gpu-lora and single-gpu-full steps (forward and backward of one micro batch, bf16) on the embedded model and
a wider one, at two rungs, measured against the forecast's matmuls, attention and adapters at those rates.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from memrecipe.planning import forecast as fc
from memrecipe.planning.activations import activation_mode, residual_bytes
from memrecipe.planning.architecture import structure
from memrecipe.planning.gpus import GPUS
from memrecipe.planning.planner import estimate
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import make_topology
from memrecipe.table import table

CONFIGS = Path(__file__).resolve().parent / "gpu_configs"
PACKED_PADDING = 0.016  # the 1B rows' packed data: padding_fraction in adamw-8bit's report.json (gpu_results)
LONG = ["activation_offload=true", "lean_norms=true", "tiled_mlp=true", "per_device_train_batch_size=1",
        "gradient_accumulation_steps=1", "packing=false"]


@dataclass(frozen=True)
class Row:
    name: str
    gpu: str
    shape: str  # "1b" or "long-8b" (Llama-3.1-8B's widths, 2 layers)
    recipe: str
    words: tuple
    attention: str
    measured: float  # tokens/s, real tokens, after the first step (where the row ran more than one)
    source: str
    role: str = "check"  # or the constant it measures
    warm: bool = True  # False: one step, its tokens/s include the first step's warm-up (and a compile)
    # the code it ran: every row recorded so far ran the tiled MLP again in each layer's recompute (before the fifth
    # lease: forecast.tiles_again); a row of the code since sets False where its recompute leaves the MLP out
    tiles_recomputed: bool = True


def long8b(kernel: str, length: int) -> tuple:
    return (*LONG, f"attn_implementation={kernel}", f"max_seq_length={length}")


ROWS = [
    Row("adamw-8bit", "H100", "1b", "adamw-8bit", (), "flex_attention", 30_464, "2026-11-27-h100", "MATMUL"),
    Row("single-gpu-lora", "H100", "1b", "single-gpu-lora", (), "flex_attention", 22_287, "docs/gpu.md, first lease",
        "ADAPTERS"),
    Row("single-gpu-lora, sdpa", "H100", "1b", "single-gpu-lora", ("attn_implementation=sdpa",), "sdpa", 21_539,
        "docs/gpu.md, first lease"),
    Row("qlora", "H100", "1b", "qlora", (), "flex_attention", 15_874, "docs/gpu.md, first lease", "DEQUANTIZE"),
    Row("qlora, activation_offload", "H100", "1b", "qlora", ("activation_offload=true",), "flex_attention", 14_364,
        "2026-11-27-h100"),
    Row("long context 16K", "H100", "1b", "single-gpu-lora", (*LONG, "max_seq_length=16384"), "sdpa", 12_741,
        "2026-11-27-h100"),
    Row("zero3-offload", "H100", "1b", "zero3-offload", (), "flex_attention", 11_903,
        "2026-11-27-h100 (its step 3: the lease ended there)", "CPU_ADAM"),
    Row("long-8b sdpa 128K", "H200", "long-8b", "single-gpu-lora", long8b("sdpa", 131072), "sdpa", 20_662,
        "2026-11-27-h200-long8b", "ATTENTION sdpa (with 256K)"),
    Row("long-8b sdpa 256K", "H200", "long-8b", "single-gpu-lora", long8b("sdpa", 262144), "sdpa", 15_612,
        "2026-11-27-h200-long8b", "ATTENTION sdpa (with 128K)"),
    Row("long-8b flex 256K", "H200", "long-8b", "single-gpu-lora", long8b("flex_attention", 262144), "flex_attention",
        12_656, "2026-11-27-h200-long8b", "ATTENTION flex_attention"),
    Row("long-8b sdpa 256K, one step", "H200", "long-8b", "single-gpu-lora", long8b("sdpa", 262144), "sdpa", 11_523,
        "2026-11-28-h200-long8b", warm=False),
    Row("long-8b sdpa 512K, one step", "H200", "long-8b", "single-gpu-lora", long8b("sdpa", 524288), "sdpa", 8_018,
        "2026-11-28-h200-long8b", warm=False),
    Row("long-8b flex 384K, one step", "H200", "long-8b", "single-gpu-lora", long8b("flex_attention", 393216),
        "flex_attention", 7_234, "2026-11-28-h200-long8b", warm=False),
    Row("long-8b flex 751K, one step", "H200", "long-8b", "single-gpu-lora", long8b("flex_attention", 769024),
        "flex_attention", 4_853, "2026-11-28-h200-long8b", warm=False),
    # the fifth lease: the 1B rows on another box's host (the H100 rows' own ran 1.25x as fast: a launch-bound LoRA
    # step, 1.08 s of kernels in 1.82 s, waits on its host), and a long row slowed by the allocator's history recorded
    Row("single-gpu-lora (H200)", "H200", "1b", "single-gpu-lora", (), "flex_attention", 17_840,
        "2026-11-28-h200-speed"),
    Row("adamw-8bit (H200)", "H200", "1b", "adamw-8bit", (), "flex_attention", 31_355, "2026-11-28-h200-speed"),
    Row("long-8b flex 128K, history recorded", "H200", "long-8b", "single-gpu-lora", long8b("flex_attention", 131072),
        "flex_attention", 15_395, "2026-11-28-h200-speed"),
]


# From outside: TRL's 1M-token example (huggingface.co/docs/trl/en/long_context_training; TRL v1.13.0's notes):
# Qwen3-8B full fine-tune, one sequence of 1,048,576 tokens a step over 8 H100s (FSDP2, context parallelism 8,
# gradient checkpointing with offload), 380 s a step. No constant is taken from it.
TRL_1M = (["max_seq_length=1048576", "parallelism.cp_size=8", "per_device_train_batch_size=1",
           "gradient_accumulation_steps=1", "packing=false", "gradient_checkpointing=true",
           "fsdp.activation_checkpointing=false", "activation_offload=true"], 380.0)


def trl_1m() -> fc.Forecast:
    """The forecast of TRL's 1M-token example as fsdp runs it here (sdpa: the FlashAttention kernel TRL's runs)."""
    s = structure(json.loads((CONFIGS / "qwen3-8b.json").read_text()))
    recipe = load_recipe("fsdp", ["embedded_settings=false", *TRL_1M[0]])
    est = estimate(recipe, s, make_topology(8, 1, 0, None, None, False), attention="sdpa")
    return fc.forecast(recipe, s, est, fc.gpu_rates(GPUS["H100"]))


def shape(name: str):
    if name == "1b":
        return structure(json.loads((CONFIGS / "llama-3.2-1b.json").read_text()))
    return structure(json.loads((CONFIGS / "llama-3.1-8b.json").read_text()) | {"num_hidden_layers": 2})


def forecast_row(row: Row, rates: fc.Rates | None = None) -> fc.Forecast:
    """The forecast of a row as it ran: its recipe, words and kernel, one process, at these rates (the GPU's)."""
    recipe = load_recipe(row.recipe, ["embedded_settings=false", *row.words])  # (the rows ran a model of their own)
    s = shape(row.shape)
    est = estimate(recipe, s, make_topology(1, 1, 0, None, None, False), attention=row.attention)
    return fc.forecast(recipe, s, est, rates or fc.gpu_rates(GPUS[row.gpu]), tiles_recomputed=row.tiles_recomputed)


def real(row: Row, f: fc.Forecast) -> float:
    """Forecast real tokens/s (the measured counts no padding: packed rows carry a little)."""
    packed = "packing=false" not in row.words
    return f.tokens_per_second * (1 - PACKED_PADDING if packed else 1)


def per_token(row: Row, f: fc.Forecast) -> dict:
    """Seconds a real token by part, and the measured seconds a token."""
    tokens = f.step_seconds * real(row, f)
    return {k: v / tokens for k, v in f.parts.items()} | {"step": f.step_seconds / tokens, "measured": 1 / row.measured}


def derive() -> dict:
    """Each constant from its row, in the order they depend on each other; the forecast's own parts, with the
    constant being measured scaled until the row's forecast time equals its measured time."""
    rows = {r.name: r for r in ROWS}
    out = {}

    def parts(name):
        return per_token(rows[name], forecast_row(rows[name]))

    # sdpa: the step time's growth from 128K to 256K is attention's alone (every other part is the same a token)
    a, b = parts("long-8b sdpa 128K"), parts("long-8b sdpa 256K")
    out["ATTENTION sdpa"] = fc.ATTENTION["sdpa"] * (b["attention"] - a["attention"]) / (b["measured"] - a["measured"])
    sdpa_attention = b["attention"] * fc.ATTENTION["sdpa"] / out["ATTENTION sdpa"]
    # flex: its 256K row less the sdpa row's time beside attention
    flex = parts("long-8b flex 256K")
    out["ATTENTION flex_attention"] = fc.ATTENTION["flex_attention"] * flex["attention"] / (
        flex["measured"] - (b["measured"] - sdpa_attention))
    fc.ATTENTION = fc.ATTENTION | {"sdpa": out["ATTENTION sdpa"], "flex_attention": out["ATTENTION flex_attention"],
                                   "flash_attention_2": out["ATTENTION sdpa"]}
    for constant, name, part in (("MATMUL", "adamw-8bit", "matmuls"), ("ADAPTERS", "single-gpu-lora", "adapters"),
                                 ("DEQUANTIZE", "qlora", "dequantize"), ("CPU_ADAM", "zero3-offload", "optimizer")):
        p = parts(name)  # (each at the constants derived before it)
        rest = p["step"] - p[part]
        old = getattr(fc, constant)
        out[constant] = old * p[part] / (p["measured"] - rest)
        setattr(fc, constant, out[constant])  # (this process only: the derivations after it use it)
    return out


def timed(fn, repeats: int = 5) -> float:
    import statistics
    import time

    fn()  # (warm)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def cpu_rates() -> fc.Rates:
    """This CPU's rates, measured in this process at the wide model's widths (bf16 autocast, as the loop runs)."""
    import sys

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from memrecipe.planning.architecture import Linear
    from memrecipe.training.cpu_matmul import bf16_matmuls_in_fp32

    bf16_matmuls_in_fp32()
    tokens, width, out = 2048, 512, 1536
    x = torch.randn(tokens, width, requires_grad=True)
    w = (torch.randn(out, width) / width**0.5).requires_grad_()
    # the matmuls alone: a 16-bit input and weight and a given gradient (autocast's casts and a loss's ops are the
    # elementwise rate's, measured below)
    x16, w16, g16 = x.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_(), \
        torch.randn(tokens, out, dtype=torch.bfloat16)

    def linear():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = F.linear(x16, w16)
        torch.autograd.grad(y, (x16, w16), g16)

    matmul = 6 * tokens * width * out / timed(linear)
    sdpa, score, block = cpu_attention()
    big = torch.randn(64 * 2**20 // 4)
    copy = 2 * big.numel() * 4 / timed(lambda: big.clone())
    from peft import LoraConfig, get_peft_model

    base = torch.nn.Sequential(torch.nn.Linear(width, out, bias=False)).requires_grad_(False)  # frozen, as under LoRA
    lora = get_peft_model(torch.nn.Sequential(torch.nn.Linear(width, out, bias=False)),  # (its dropout: below)
                          LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["0"]))

    def through(module):
        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = module(x)
            y.float().sum().backward()
        return run

    extra = max(timed(through(lora)) - timed(through(base)), 1e-9)
    recipe = load_recipe("single-gpu-lora", ["lora.target_modules=[x]", "gradient_checkpointing=false",
                                             "lora.dropout=0"])
    one = replace(shape("1b"), linears=(Linear("x", width, out),), layers=1, blocks=())
    adapters = fc.adapter_bytes(recipe, one) * tokens / extra  # (its passes: one forward, a backward of two)
    noise = torch.randn(tokens, width)  # dropout as peft's adapters draw it: over their fp32 input
    dropout = noise.numel() / timed(lambda: F.dropout(noise, 0.05, training=True))
    rates = fc.Rates("this CPU (measured)", matmul, {"sdpa": sdpa}, adapters, copy, copy, copy, copy, dropout=dropout,
                     cpu_attention=True, attention_score=score, attention_block=block,
                     elementwise=elementwise(tokens, width, out))
    return replace(rates, **dispatch(rates))


def elementwise(tokens: int, width: int, intermediate: int) -> float:
    """Bytes/s of a layer's elementwise ops on this CPU: transformers' LlamaRMSNorm over a 16-bit stream, its weight
    trained, and the SwiGLU product, forward and backward under autocast at these widths; their bytes counted op by
    op as the tests count a layer's (measuring.elementwise_bytes_moved), their seconds timed."""
    import torch
    import torch.nn.functional as F
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from measuring import elementwise_bytes_moved

    norm = LlamaRMSNorm(width).to(torch.bfloat16)
    x = torch.randn(tokens, width, dtype=torch.bfloat16, requires_grad=True)
    gate, up = (torch.randn(tokens, intermediate, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def ops():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = norm(x)
            z = F.silu(gate) * up
        torch.autograd.backward([y, z], [torch.ones_like(y), torch.ones_like(z)])

    return elementwise_bytes_moved(ops) / timed(ops)


# Shapes sdpa's CPU kernel is timed at (batch, heads, tokens, head_dim): short rows, where its blocks' fixed costs
# tell, long ones, where its FLOPs do, and head widths 32-128.
ATTENTION_SHAPES = [(4, 4, 256, 32), (2, 8, 128, 64), (1, 8, 512, 64), (1, 4, 1024, 32), (1, 8, 2048, 64),
                    (1, 4, 2048, 128)]


def cpu_attention() -> tuple[float, float, float]:
    """Causal sdpa's rates on this CPU, forward and backward in bf16: its FLOP/s, and its seconds a score and a
    (query block, key block) pair beside them, solved from ATTENTION_SHAPES (least squares on relative time) with
    the work counted as the forecast counts it (forecast.cpu_flash_work). Prints how far each shape's time is from
    the three terms, and the kernel's causal time over its unmasked time beside the share of the square it counts."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    def run(q, k, v, causal):
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal).float().sum().backward()

    work, seconds = [], []
    for batch, heads, length, dim in ATTENTION_SHAPES:
        q, k, v = (torch.randn(batch, heads, length, dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        share, pairs = fc.cpu_flash_work(length)
        scores = batch * heads * share * length**2
        work.append((3.5 * 4 * scores * dim, scores, batch * heads * pairs))
        seconds.append(timed(run(q, k, v, True)))
        unmasked = timed(run(q, k, v, False))
        print(f"sdpa {batch} x {heads} heads x {length} tokens x {dim}: {seconds[-1] * 1e3:.1f} ms, "
              f"causal over unmasked {seconds[-1] / unmasked:.2f} (the kernel's blocks: {share:.2f})", flush=True)
    a, y = np.array(work), np.array(seconds)
    per_flop, score, block = np.linalg.lstsq(a / y[:, None], np.ones(len(y)), rcond=None)[0]
    print("sdpa's three terms over each time:", " ".join(f"{v:.2f}" for v in a @ [per_flop, score, block] / y))
    return 1 / per_flop, score, block


# The embedded model's runs dispatch() times: recipe, gradient_checkpointing, more words.
DISPATCH_RUNS = {
    "full": ("single-gpu-full", "false", []), "checkpointed": ("single-gpu-full", "true", []),
    "lora": ("single-gpu-lora", "false", []), "lora checkpointed": ("single-gpu-lora", "true", []),
    "activation_offload": ("single-gpu-full", "true", ["activation_offload=true"]),
    "lean_norms": ("single-gpu-full", "true", ["lean_norms=true"]),
    "untiled": ("single-gpu-full", "true", ["optimizer_in_backward=false"]),  # (a tiled MLP steps apart)
    "tiles": ("single-gpu-full", "true", ["optimizer_in_backward=false", "tiled_mlp=4"]),
    "lora tiles": ("single-gpu-lora", "true", ["tiled_mlp=4"])}


def dispatch(rates: fc.Rates, tokens: int = 8) -> dict:
    """The CPU's seconds beside the arithmetic, from the embedded model's step at a few tokens (all overhead but for
    attention's blocks and the elementwise ops' bytes, taken off at these rates) with 2 and 6 layers (DISPATCH_RUNS), a layer's from the
    difference: a decoder layer's ops a pass and a LoRA adapter's (LoRA on every linear); a checkpointed layer's
    recompute beyond a pass (torch.utils.checkpoint's own work: its saved-tensor hooks, autocast's casts again);
    each rung's own beyond full checkpointing (the offload's hooks, the lean norms' functions); a tile of the tiled
    MLP (four tiles), and an adapter's in it; and the rest of a micro batch (embedding, final norm, loss). Returns
    the Rates fields."""
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from memrecipe.training.loading import embedded_model
    from long_context import step
    from helpers import loop_model

    seconds = {}
    with tempfile.TemporaryDirectory() as folder:
        for layers in (2, 6):
            config = AutoConfig.from_pretrained(embedded_model())
            config.num_hidden_layers = layers
            path = Path(folder) / str(layers)
            AutoModelForCausalLM.from_config(config).save_pretrained(path)
            AutoTokenizer.from_pretrained(embedded_model()).save_pretrained(path)
            for run, (name, checkpointing, words) in DISPATCH_RUNS.items():
                recipe = load_recipe(name, [f"gradient_checkpointing={checkpointing}", f"max_seq_length={tokens}",
                                            "per_device_train_batch_size=1", "packing=false", "attn_implementation=sdpa",
                                            *(["lora.target_modules=all-linear"] if "lora" in name else []), *words])
                model, _ = loop_model(recipe, str(path), "bf16")
                model.train()
                ids = torch.randint(0, config.vocab_size, (1, tokens))
                batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids),
                         "position_ids": torch.arange(tokens)[None]}
                s = structure(config.to_dict())
                seconds[run, layers] = timed(partial(step, model, batch), repeats=20) - fc.attention_seconds(
                    recipe, s, tokens, 1, "sdpa", rates) - fc.elementwise_bytes(
                    recipe, s, residual_bytes(activation_mode(recipe, 2))) * tokens / rates.elementwise
    per_layer = {run: (seconds[run, 6] - seconds[run, 2]) / 4 for run in DISPATCH_RUNS}
    layer = per_layer["full"] / 3
    adapters = len(shape("1b").linears)
    mlp = 3  # (the MLP's adapters: gate, up, down)
    tile = (per_layer["tiles"] - per_layer["untiled"]) / 4
    lora_tile = (per_layer["lora tiles"] - per_layer["lora checkpointed"]) / 4
    return {"layer_dispatch": layer, "adapter_dispatch": max((per_layer["lora"] / 3 - layer) / adapters, 0.0),
            "recompute_dispatch": max(per_layer["checkpointed"] - per_layer["full"] - layer, 0.0),
            "model_dispatch": seconds["full", 2] - 2 * 3 * layer,
            "rung_dispatch": {rung: max(per_layer[rung] - per_layer["checkpointed"], 0.0)
                              for rung in ("activation_offload", "lean_norms")},
            "tile_dispatch": max(tile, 0.0), "tile_adapter_dispatch": max((lora_tile - tile) / mlp, 0.0)}


CPU_ROWS = [("single-gpu-lora", ["gradient_checkpointing=true"]), ("single-gpu-lora", ["gradient_checkpointing=true",
              "activation_offload=true", "lean_norms=true", "tiled_mlp=true"]),
             ("single-gpu-full", ["gradient_checkpointing=true"]), ("single-gpu-full", ["gradient_checkpointing=false"])]
# attention in query chunks: the wide model's whole rows, and the windowed model's bands (each chunk under its mask)
CHUNK_ROWS = [("single-gpu-lora", ["gradient_checkpointing=true", "query_chunks=256"])]
WINDOW = 512  # the windowed model's: a 2,048-token row passes it, each 256-query chunk reaching 767 keys


def windowed_model(wide_path: str, folder: Path) -> str:
    """The wide model's widths (its folder: `wide_path`) as a Mistral whose every layer is a sliding window of WINDOW
    keys, saved in `folder`."""
    from transformers import AutoConfig, AutoModelForCausalLM, MistralConfig

    wide = AutoConfig.from_pretrained(wide_path)
    config = MistralConfig(**{key: getattr(wide, key) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings")}, head_dim=wide.head_dim, sliding_window=WINDOW)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


def cpu_table(rates: fc.Rates, lengths: dict) -> list:
    """Forecast against measured seconds of one micro batch's forward and backward (bf16, one row), per recipe and
    rung, on the embedded model and the wide one (benchmarks/long_context.py's), and in query chunks on the wide one
    and on a windowed Mistral of its widths (forecast.cpu_band_work)."""
    import tempfile

    import torch

    from helpers import loop_model
    from long_context import step, wide_model

    from memrecipe.planning.architecture import read_config
    from memrecipe.training.loading import embedded_model

    body = []
    with tempfile.TemporaryDirectory() as folder:
        wide = wide_model(Path(folder))
        models = {"embedded": (embedded_model(), CPU_ROWS), "wide": (wide, CPU_ROWS + CHUNK_ROWS),
                  "windowed": (windowed_model(wide, Path(folder) / "windowed"), CHUNK_ROWS)}
        for label, (path, rows) in models.items():
            s = structure(read_config(path))
            for name, words in rows:
                length = lengths[label]
                recipe = load_recipe(name, [*words, f"max_seq_length={length}", "per_device_train_batch_size=1",
                                            "gradient_accumulation_steps=1", "packing=false", "attn_implementation=sdpa"])
                model, _ = loop_model(recipe, path, "bf16")
                model.train()
                ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
                batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids),
                         "position_ids": torch.arange(length)[None]}
                measured = timed(partial(step, model, batch), repeats=3)
                est = estimate(recipe, s, make_topology(1, 1, 0, None, None, True), attention="sdpa")
                f = fc.forecast(recipe, s, est, rates)
                forecast = sum(v for k, v in f.parts.items()
                               if k in ("matmuls", "attention", "adapters", "dispatch", "dropout", "elementwise"))
                rung = " ".join(w.split("=")[0] for w in words if w.endswith("true") or w.startswith("query_chunks")) \
                    or "no checkpointing"
                body.append([label, length, name, rung, f"{length / measured:,.0f}", f"{length / forecast:,.0f}",
                             f"{measured / forecast:.2f}"])
                print(*body[-1], flush=True)
    return body


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--derive", action="store_true", help="recompute each efficiency constant from its row")
    parser.add_argument("--cpu", action="store_true", help="this CPU's rates, and forecast vs measured steps on it")
    args = parser.parse_args()
    if args.cpu:
        rates = cpu_rates()
        print(f"this CPU: matmuls {rates.matmul / 1e9:.0f} GFLOP/s, causal sdpa {rates.attention['sdpa'] / 1e9:.0f} "
              f"GFLOP/s and {rates.attention_score * 1e9:.2f} ns a score, {rates.attention_block * 1e6:.0f} us a "
              f"block, LoRA's adapters {rates.adapters / 1e9:.1f} GB/s, dropout {rates.dropout / 1e6:.0f}M "
              f"elements/s, copies {rates.bandwidth / 1e9:.1f} GB/s, elementwise ops {rates.elementwise / 1e9:.1f} GB/s; "
              f"dispatch a pass: {rates.layer_dispatch * 1e3:.2f} ms a layer, {rates.adapter_dispatch * 1e3:.2f} ms "
              f"an adapter, {rates.recompute_dispatch * 1e3:.2f} ms a checkpointed layer's recompute beyond that, "
              f"{rates.model_dispatch * 1e3:.2f} ms the rest of a micro batch; a layer's step beyond full "
              f"checkpointing: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in rates.rung_dispatch.items())
              + f", a tile {rates.tile_dispatch * 1e3:.2f} ms and {rates.tile_adapter_dispatch * 1e3:.2f} ms an adapter "
              f"in it")
        body = cpu_table(rates, {"embedded": 256, "wide": 2048, "windowed": 2048})
        print(table(["MODEL", "TOKENS", "RECIPE", "RUNG", "MEASURED tok/s", "FORECAST tok/s", "RATIO"], body))
        return
    if args.derive:
        for name, value in derive().items():
            print(f"{name} = {value:.3g}")
        return
    body = []
    for row in ROWS:
        f = forecast_row(row)
        ratio = real(row, f) / row.measured
        body.append([row.name, row.gpu, row.attention, f"{row.measured:,.0f}", f"{real(row, f):,.0f}", f"{ratio:.2f}",
                     row.role if row.warm else "check (one step: warm-up in the measured)", row.source])
    print(table(["ROW", "GPU", "ATTENTION", "MEASURED tok/s", "FORECAST tok/s", "RATIO", "ROLE", "SOURCE"], body))
    print("RATIO: forecast over measured speed (above 1: the forecast is too fast)")
    f = trl_1m()
    print(f"\nTRL's 1M-token example (Qwen3-8B, 8 x H100, FSDP2 + context parallelism 8): {TRL_1M[1]:.0f} s a step "
          f"measured, {f.step_seconds:.0f} forecast (fsdp, parallelism.cp_size=8): RATIO {TRL_1M[1] / f.step_seconds:.2f}")


if __name__ == "__main__":
    main()

