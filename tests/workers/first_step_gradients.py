"""Worker, launched by `accelerate launch` with a recipe's generated config: the loop's first window
(recipes/sft.py's own loader, data order and accumulate_window), and every trainable parameter's whole
gradient before the optimizer touches it; then two epochs of optimizer steps (constant learning rate, no
clipping: set max_grad_norm=null). Rank 0 saves the gradients, the first window's loss, and every step's.

    accelerate launch --config_file CONFIG first_step_gradients.py RESULT.pt RECIPE [key=value ...]

Under DeepSpeed the engine steps inside the window's last backward: the gradients are read in the
step itself, before it runs."""

import sys

import memrecipe  # noqa: F401
import torch
from accelerate.utils import set_seed

from helpers import REPO, loop_model

sys.path.insert(0, str(REPO / "recipes"))
from sft import accumulate_window, setup_data, windows  # noqa: E402  (the loop's own functions)

from memrecipe.training.loss import fuse_head  # noqa: E402
from memrecipe.training.optimizers import make_optimizer  # noqa: E402
from memrecipe.training.accelerator import make_accelerator, prepare, wrap_first  # noqa: E402
from memrecipe.training.loading import embedded_model
from memrecipe.training.tokenizer import load_tokenizer
from memrecipe.planning.registry import load_recipe  # noqa: E402

result_path, name, *overrides = sys.argv[1:]
recipe = load_recipe(name, overrides)
path = embedded_model()
accelerator = make_accelerator(recipe)
set_seed(recipe.seed)  # as the loop does: the seeded sampler draws from it
tokenizer = load_tokenizer(path)
model, _ = loop_model(recipe, path, accelerator.mixed_precision, accelerator.device)
fuse_head(model)
loader, _ = setup_data(recipe, tokenizer, accelerator, lambda *a, **k: None)
model = wrap_first(accelerator, recipe, model)
optimizer = make_optimizer(recipe, model, accelerator)
model, optimizer, loader = prepare(accelerator, recipe, model, optimizer, loader)
# FSDP's activation checkpointing wraps each layer: its names gain the wrapper's prefix
names = {id(p): n.replace("_checkpoint_wrapped_module.", "") for n, p in accelerator.unwrap_model(model).named_parameters()}
grads = {}


def full_grads():
    for p in accelerator.unwrap_model(model).parameters():
        if not p.requires_grad:
            continue
        if hasattr(model, "zero_optimization_stage"):
            from deepspeed.utils import safe_get_full_grad

            g = safe_get_full_grad(p)
        else:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[names[id(p)]] = g.detach().float().cpu().clone()


if hasattr(model, "zero_optimization_stage"):  # the engine steps in the last backward: read first
    step = model.step

    def reading_step(*args, **kwargs):
        if model.is_gradient_accumulation_boundary() and not grads:  # the first window's
            full_grads()
        return step(*args, **kwargs)

    model.step = reading_step
losses = []
for epoch in range(2):
    loader.set_epoch(epoch)  # as the loop does: the seeded shuffle of this epoch, the same on every process
    for window in windows(loader, accelerator.gradient_accumulation_steps):
        loss, targets = accumulate_window(model, window, accelerator)
        if not grads:
            full_grads()
        if not losses:
            first = {"loss": loss, "targets": targets}
        losses.append(loss)
        optimizer.step()  # (DeepSpeed's engine stepped in the window's last backward: the wrapper's step is a no-op)
        optimizer.zero_grad()
if accelerator.is_main_process:
    torch.save({**first, "grads": grads, "losses": losses, "rows": len(loader.dataset),
                "processes": accelerator.num_processes, "distributed_type": accelerator.distributed_type.value},
               result_path)
accelerator.wait_for_everyone()  # the result is written: all ranks tear down together
accelerator.end_training()
