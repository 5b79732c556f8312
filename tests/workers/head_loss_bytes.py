"""Worker: the fused loss's peak bytes for one model shape, measured (LossMemory, the report card's figure) and
planned (the planner's `logits`), printed as JSON. One measurement per process: the CPU profiler remembers blocks
it saw in earlier profiles, so a second one in the same process can miss a same-sized buffer.

    python head_loss_bytes.py MODE HIDDEN TOKENS_PER_CHUNK [VOCAB ROWS SEQ] [--cuda-tiles]

MODE: lora (a frozen bf16 head under autocast), mixed (a trained fp32 head under autocast), half (trained bf16
weights, no autocast) or fp32. Every token is a target; one decoder layer."""

import json
import sys

import memrecipe  # noqa: F401
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from memrecipe.planning.architecture import structure
from memrecipe.planning.activations import activation_bytes, activation_mode
from memrecipe.planning.registry import load_recipe
from memrecipe.training.cpu_matmul import bf16_matmuls_in_fp32
from memrecipe.training.loss import fuse_head, lm_loss
from memrecipe.training.probes import LossMemory

RECIPES = {"lora": ("single-gpu-lora", []), "mixed": ("single-gpu-full", ["weight_dtype=fp32"]),
           "half": ("single-gpu-full", ["weight_dtype=bf16", "mixed_precision=no"]),
           "fp32": ("single-gpu-full", ["weight_dtype=fp32", "mixed_precision=no"])}

if "--cuda-tiles" in sys.argv:  # HeadLoss's backward tiles as on a GPU (training.loss.tile_rows), run here
    from memrecipe.training import loss

    whole = loss.tile_rows
    loss.tile_rows = lambda *args, **kwargs: whole(*args, **{**kwargs, "cuda": True})
    sys.argv.remove("--cuda-tiles")
mode, hidden, tokens, *shape = sys.argv[1:]
vocab, rows, seq = map(int, shape or (32000, 2, 256))
config = {"vocab_size": vocab, "hidden_size": int(hidden), "intermediate_size": 2 * int(hidden), "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": seq, "tie_word_embeddings": False}
name, overrides = RECIPES[mode]
bf16_matmuls_in_fp32()  # as the loop computes on this CPU (the bytes torch counts are the native kernels')
recipe = load_recipe(name, [*overrides, "optimizer_in_backward=false", f"loss_chunk_tokens={tokens}",
                            f"per_device_train_batch_size={rows}", f"max_seq_length={seq}"])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
if mode in ("half", "lora"):
    model = model.to(torch.bfloat16)
if mode == "lora":  # the base frozen; something before the head trains
    model.requires_grad_(False)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)
fuse_head(model, recipe.loss_chunk_tokens)
ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
memory = LossMemory(model, torch.device("cpu"))
with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.mixed_precision != "no"):
    loss = lm_loss(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
loss.backward()
mode_planned = activation_mode(recipe, 4 if recipe.mixed_precision == "no" else 2)
assert mode_planned == mode, (mode_planned, mode)
planned = activation_bytes(recipe, structure({"model_type": "llama", **config}), mode, rows, seq)["logits"]
print(json.dumps({"measured": memory.bytes, "planned": planned}))
