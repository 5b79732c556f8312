"""Worker, launched by `accelerate launch` with a recipe's generated config: on this engine (DDP, FSDP2,
DeepSpeed ZeRO-2/3), the fused loss gives the plain loss, gradients and eval loss, and really ran fused.

    accelerate launch --config_file CONFIG fused_vs_plain.py RESULT.json RECIPE [key=value ...]

The head is fused with small chunks (7 tokens), so every micro batch runs many of them; each chunk is counted.
FUSED_VARIANTS (DDP only: one engine holds one model) adds models to compare in the same launch: `tied` (the
head shares the embeddings' weight) and `lora-head` (LoRA on q, v and the head). RESULT.json maps each variant
("base" first) to its figures."""

import json
import os
import sys

import memrecipe  # noqa: F401
import torch
from torch.utils.data import DataLoader

import memrecipe.training.loss as fused_loss
from helpers import loop_model  # noqa: E402
from memrecipe.training.data import Collator, prepare_datasets
from memrecipe.training.loss import count_targets, fuse_head, lm_loss, model_inputs, output_head, token_loss
from memrecipe.training.optimizers import make_optimizer
from memrecipe.training.accelerator import make_accelerator, prepare, wrap_first
from memrecipe.training.loading import embedded_model
from memrecipe.training.tokenizer import load_tokenizer
from memrecipe.planning.registry import load_recipe

CHUNK = 7
VARIANTS = {"base": [], "tied": [], "lora-head": ["lora.r=8", "lora.target_modules=[q_proj,v_proj,lm_head]",
                                                  "lora.dropout=0"]}
result_path, name, *overrides = sys.argv[1:]
variants = ["base", *filter(None, os.environ.get("FUSED_VARIANTS", "").split(","))]
path = embedded_model()
accelerator = make_accelerator(load_recipe(name, overrides))
tokenizer = load_tokenizer(path)
chunks = []  # the tokens of each chunk (forward) and tile (backward) the head computes logits for
real_chunk_logits = fused_loss._chunk_logits


def counted_chunk_logits(*args):  # the fused head calls it by its module name: forward and backward both count
    chunks.append(len(args[1]))
    return real_chunk_logits(*args)


fused_loss._chunk_logits = counted_chunk_logits


def compare(variant: str) -> dict:
    recipe = load_recipe(name, [*overrides, *VARIANTS[variant]])
    model, _ = loop_model(recipe, path, accelerator.mixed_precision, accelerator.device)
    if variant == "tied":
        model.lm_head.weight = model.model.embed_tokens.weight
    assert fuse_head(model, CHUNK) is None
    train, _ = prepare_datasets(recipe, tokenizer)
    loader = DataLoader(train, batch_size=recipe.per_device_train_batch_size, collate_fn=Collator(tokenizer.pad_token_id))
    model = wrap_first(accelerator, recipe, model)
    optimizer = make_optimizer(recipe, model, accelerator)
    model, optimizer, loader = prepare(accelerator, recipe, model, optimizer, loader)
    batch = next(iter(loader))
    deepspeed = hasattr(model, "zero_optimization_stage")

    def full_grads():
        """Every trainable parameter's whole gradient, on every rank."""
        out = {}
        for n, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if deepspeed:
                from deepspeed.utils import safe_get_full_grad

                g = safe_get_full_grad(p)
            else:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[n] = g.detach().clone().float()
        return out

    def loss_and_grads(fused: bool):
        chunks.clear()
        if fused:
            loss = lm_loss(model, batch)
        else:
            logits = model(**model_inputs(batch)).logits
            loss = token_loss(logits, batch["labels"])
        model.backward(loss) if deepspeed else accelerator.backward(loss)  # the engine's backward, no step
        grads = full_grads()
        model.optimizer.zero_grad() if deepspeed else optimizer.zero_grad()
        return loss.item(), grads, list(chunks)

    plain_loss, plain, plain_chunks = loss_and_grads(False)
    fused_loss_value, fused, fused_chunks = loss_and_grads(True)
    with torch.no_grad():
        model.eval()
        plain_eval = token_loss(model(**model_inputs(batch)).logits, batch["labels"], per_sequence=True)
        fused_eval = lm_loss(model, batch, per_sequence=True)
    head = output_head(model)
    unwrapped = accelerator.unwrap_model(model)
    return {"plain_loss": plain_loss, "fused_loss": fused_loss_value, "grads": len(plain),
            "max_grad_diff": max((plain[n] - fused[n]).abs().max().item() for n in plain),
            "max_grad": max(g.abs().max().item() for g in plain.values()),
            "head_grads": sum(p.requires_grad for p in head.parameters()),  # its weights (tied: the embeddings'), or adapters
            "max_eval_diff": (plain_eval - fused_eval).abs().max().item(), "eval_sequences": len(plain_eval),
            "max_eval": plain_eval.abs().max().item(),  # a packed row sums ~256 token losses
            # forward and backward: every target of this rank's batch, in chunks of at most CHUNK; none on the plain path
            "chunk_max": max(fused_chunks), "chunk_tokens": sum(fused_chunks), "targets": count_targets(batch),
            "plain_chunks": len(plain_chunks),
            "head_lora": hasattr(head, "lora_A"), "z3_leaf": getattr(head, "_z3_leaf", False),
            "tied": unwrapped.get_output_embeddings().weight is unwrapped.get_input_embeddings().weight,
            "distributed_type": accelerator.distributed_type.value, "num_processes": accelerator.num_processes}


results = {variant: compare(variant) for variant in variants}
if accelerator.is_main_process:
    with open(result_path, "w") as f:
        json.dump(results, f)
accelerator.wait_for_everyone()  # the result is written: all ranks tear down together
accelerator.end_training()
