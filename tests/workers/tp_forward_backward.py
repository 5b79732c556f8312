"""Worker: the tp recipe's model loading on 4 gloo ranks, a dp_shard 2 x tp 2 mesh as accelerate's
ParallelismConfig builds it (transformers' tensor-parallel plan over its "tp" dimension), one forward and
backward next to the unsplit model; accelerate's data sharding over that mesh and the loop's token count;
rank 0 saves what it saw."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from helpers import loop_model  # noqa: E402
from memrecipe.training.loss import token_loss
from memrecipe.training.loading import embedded_model
from memrecipe.planning.registry import load_recipe

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
recipe = load_recipe("tp", ["mixed_precision=no"])
path = embedded_model()
split, _ = loop_model(recipe, path, "no", device_mesh=mesh)  # the loop's own loading code
whole, _ = loop_model(load_recipe("ddp", ["mixed_precision=no"]), path, "no")
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

# The data: accelerate gives each TP group one batch (its prepare_data_loader over the mesh); the loop's
# count over all processes must see each batch once.
from accelerate import PartialState  # noqa: E402
from accelerate.data_loader import prepare_data_loader  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from memrecipe.training.data import Collator  # noqa: E402
from memrecipe.training.meter import window_counts  # noqa: E402

PartialState(cpu=True)
rows = [{"input_ids": list(range(1, 3 + i)), "labels": list(range(1, 3 + i))} for i in range(8)]  # 2..9 tokens
loader = prepare_data_loader(DataLoader(rows, batch_size=2, collate_fn=Collator(0)), num_processes=4,
                             process_index=dist.get_rank(), torch_device_mesh=mesh, put_on_device=False)
window = [next(iter(loader))]
seen = [None] * 4
dist.all_gather_object(seen, window[0]["input_ids"].tolist())
reduce = lambda t: (dist.all_reduce(t), t)[1]  # noqa: E731
counts, _ = window_counts(window, 0, reduce, tp_size=2)
distinct = {tuple(map(tuple, batch)) for batch in seen}
if dist.get_rank() == 0:
    result = {"losses": losses, "max_grad_diff": diff, "sharded_tensors": sharded, "local_numel": local_numel,
              "numel": sum(p.numel() for p in whole.parameters()), "layers": whole.config.num_hidden_layers,
              "batches": seen, "counted_tokens": counts["tokens"],
              "distinct_tokens": sum(sum(t != 0 for t in row) for batch in distinct for row in batch)}
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
dist.barrier()  # rank 0 has written the file: all leave the process group together
dist.destroy_process_group()  # a rank exiting with gloo's threads alive can abort (SIGABRT, seen in CI)
