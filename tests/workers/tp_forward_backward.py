"""Worker: the tp recipe's model loading on 4 gloo ranks, a dp_shard 2 x tp 2 mesh as accelerate's
ParallelismConfig builds it (transformers' tensor-parallel plan over its "tp" dimension), one forward and
backward next to the unsplit model; rank 0 saves what it saw."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from memrecipe.loss import token_loss
from memrecipe.modeling import embedded_model, load_model
from memrecipe.registry import load_recipe

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
recipe = load_recipe("tp", ["mixed_precision=no"])
path = embedded_model()
split, _ = load_model(recipe, path, "no", device_mesh=mesh)  # the loop's own loading code
whole, _ = load_model(load_recipe("ddp", ["mixed_precision=no"]), path, "no")
ids = torch.randint(0, whole.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
losses = {}
for name, model in (("split", split), ("whole", whole)):
    loss = token_loss(model(input_ids=ids).logits, ids) / ids[:, 1:].numel()
    loss.backward()
    losses[name] = loss.item()
grads = dict(whole.named_parameters())
diff, sharded, local_numel = 0.0, 0, 0
for name, p in split.named_parameters():
    local = p.to_local() if hasattr(p, "to_local") else p
    local_numel += local.numel()
    if hasattr(p, "placements") and any(pl.is_shard() for pl in p.placements):
        sharded += 1
    grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
    diff = max(diff, (grad - grads[name].grad).abs().max().item())
if dist.get_rank() == 0:
    result = {"losses": losses, "max_grad_diff": diff, "sharded_tensors": sharded, "local_numel": local_numel,
              "numel": sum(p.numel() for p in whole.parameters()), "layers": whole.config.num_hidden_layers}
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
dist.destroy_process_group()
