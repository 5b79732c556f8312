"""Worker, launched by `accelerate launch` with a recipe's generated config: the loop's first window
(recipes/sft.py's own data order and accumulate_window), and every trainable parameter's whole
gradient before the optimizer touches it; rank 0 saves them with the window's loss.

    accelerate launch --config_file CONFIG first_step_gradients.py RESULT.pt RECIPE [key=value ...]

Under DeepSpeed the engine steps inside the window's last backward: the gradients are read in the
step itself, before it runs."""

import sys

import memrecipe  # noqa: F401
import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from helpers import REPO

sys.path.insert(0, str(REPO / "recipes"))
from sft import accumulate_window, windows  # noqa: E402  (the loop's own functions)

from memrecipe.data import Collator, prepare_datasets  # noqa: E402
from memrecipe.loss import fuse_head  # noqa: E402
from memrecipe.optimizers import make_optimizer  # noqa: E402
from memrecipe.modeling import embedded_model, load_model, load_tokenizer, make_accelerator, prepare, wrap_first  # noqa: E402
from memrecipe.registry import load_recipe  # noqa: E402

result_path, name, *overrides = sys.argv[1:]
recipe = load_recipe(name, overrides)
path = embedded_model()
accelerator = make_accelerator(recipe)
set_seed(recipe.seed)  # as the loop does: the seeded sampler draws from it
tokenizer = load_tokenizer(path)
model, _ = load_model(recipe, path, accelerator.mixed_precision, accelerator.device)
fuse_head(model)
train, _ = prepare_datasets(recipe, tokenizer)
loader = DataLoader(train, batch_size=recipe.per_device_train_batch_size, shuffle=True,
                    collate_fn=Collator(tokenizer.pad_token_id), generator=torch.Generator().manual_seed(recipe.seed))
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
        if model.is_gradient_accumulation_boundary():
            full_grads()
        return step(*args, **kwargs)

    model.step = reading_step
if hasattr(loader, "set_epoch"):
    loader.set_epoch(0)  # as the loop does: the seeded shuffle of epoch 0, the same on every process
window = next(windows(loader, accelerator.gradient_accumulation_steps))
loss, targets = accumulate_window(model, window, accelerator)
if not grads:
    full_grads()
if accelerator.is_main_process:
    torch.save({"loss": loss, "targets": targets, "grads": grads, "processes": accelerator.num_processes,
                "distributed_type": accelerator.distributed_type.value}, result_path)
accelerator.end_training()
