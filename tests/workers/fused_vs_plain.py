"""Worker, launched by `accelerate launch` with a recipe's generated config: on this engine (DDP,
FSDP2, DeepSpeed ZeRO-3), the fused loss gives the plain loss, gradients and eval loss.

    accelerate launch --config_file CONFIG fused_vs_plain.py RESULT.json RECIPE [key=value ...]

The head is fused with small chunks (7 tokens), so every micro batch runs many of them."""

import json
import sys

import memrecipe  # noqa: F401
import torch
from torch.utils.data import DataLoader

from memrecipe.data import Collator, prepare_datasets
from memrecipe.loss import fuse_head, lm_loss, model_inputs, output_head, token_loss
from memrecipe.optimizers import make_optimizer
from memrecipe.modeling import embedded_model, load_model, load_tokenizer, make_accelerator, prepare, wrap_first
from memrecipe.registry import load_recipe

result_path, name, *overrides = sys.argv[1:]
recipe = load_recipe(name, overrides)
path = embedded_model()
accelerator = make_accelerator(recipe)
tokenizer = load_tokenizer(path)
model, _ = load_model(recipe, path, accelerator.mixed_precision, accelerator.device)
assert fuse_head(model, chunk_elements=7 * model.config.vocab_size) is None
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
    if fused:
        loss = lm_loss(model, batch)
    else:
        logits = model(**model_inputs(batch)).logits
        loss = token_loss(logits, batch["labels"])
    model.backward(loss) if deepspeed else accelerator.backward(loss)  # the engine's backward, no step
    grads = full_grads()
    model.optimizer.zero_grad() if deepspeed else optimizer.zero_grad()
    return loss.item(), grads


plain_loss, plain = loss_and_grads(False)
fused_loss, fused = loss_and_grads(True)
with torch.no_grad():
    model.eval()
    plain_eval = token_loss(model(**model_inputs(batch)).logits,
                            batch["labels"], per_sequence=True)
    fused_eval = lm_loss(model, batch, per_sequence=True)
head = output_head(model)
result = {"plain_loss": plain_loss, "fused_loss": fused_loss, "grads": len(plain),
          "max_grad_diff": max((plain[n] - fused[n]).abs().max().item() for n in plain),
          "max_grad": max(g.abs().max().item() for g in plain.values()),
          "head_grads": sum("lm_head" in n for n in plain),
          "max_eval_diff": (plain_eval - fused_eval).abs().max().item(), "eval_sequences": len(plain_eval),
          "max_eval": plain_eval.abs().max().item(),  # a packed row sums ~256 token losses
          "head_class": type(head).__name__, "z3_leaf": getattr(head, "_z3_leaf", False),
          "distributed_type": accelerator.distributed_type.value, "num_processes": accelerator.num_processes}
if accelerator.is_main_process:
    with open(result_path, "w") as f:
        json.dump(result, f)
accelerator.end_training()
