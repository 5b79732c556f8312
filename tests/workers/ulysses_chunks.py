"""sdpa's attention in query chunks inside DeepSpeed's Ulysses attention, launched on 2 gloo processes (torchrun): the
model as the loop builds it (tests/helpers.loop_model: query_chunks registers its chunks as sdpa, the kernel the
wrapper reads) with the Ulysses attention registered as accelerate's prepare registers it, one sequence cut into the
group's slices as DeepSpeed's adapter cuts it, in fp32 or in bf16 (`mixed_precision=bf16`: the model cast, as
DeepSpeed's engine casts it). Rank 0 writes its slice's loss, the chunked kernels' calls (a sliding-window layer's
in `bands`) and every parameter's gradient (torch.save), to compare with the same run in one call a row, and the
group's: the losses and gradients summed over the processes (as DeepSpeed's reduction sums them), to compare with
one process holding the whole sequence.

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/ulysses_chunks.py OUT.pt MODEL LENGTH [key=value ...]
"""

import sys

import deepspeed
import torch
from torch.nn import functional as F

import memrecipe  # noqa: F401  (quiets library notices, as the loop does)
from helpers import loop_model
from memrecipe.planning.registry import load_recipe
from memrecipe.training import query_chunks

out, model_path, length, words = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
deepspeed.init_distributed("gloo")
rank, sp = torch.distributed.get_rank(), torch.distributed.get_world_size()
calls, bands = [], []
forward, banded = query_chunks.QueryChunkedAttention.forward, query_chunks.BandedAttention.forward


def counted(ctx, q, k, v, chunk, scale):
    calls.append(q.shape)  # [b, the process's heads, the whole sequence, d]
    return forward(ctx, q, k, v, chunk, scale)


def counted_band(ctx, q, k, v, chunk, scale, window):
    bands.append([*q.shape, window])
    return banded(ctx, q, k, v, chunk, scale, window)


query_chunks.QueryChunkedAttention.forward = staticmethod(counted)
query_chunks.BandedAttention.forward = staticmethod(counted_band)
recipe = load_recipe("zero3-ulysses", words)
torch.manual_seed(0)
model, _ = loop_model(recipe, model_path, "no", engine="DEEPSPEED")
if recipe.mixed_precision == "bf16":  # DeepSpeed's bf16: the engine casts the model, no autocast
    model.to(torch.bfloat16)
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF  # noqa: E402

UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
                                                micro_batch_size=1, seq_length_is_variable=True, disable_in_eval=True)
model.train()
ids = torch.randint(4, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
shifted = F.pad(ids, (0, 1), value=-100)[:, 1:]  # ulysses_sp.py, UlyssesSPDataLoaderAdapter.refill
part = slice(rank * length // sp, (rank + 1) * length // sp)
logits = model(input_ids=ids[:, part], attention_mask=torch.ones_like(ids[:, part]),
               position_ids=torch.arange(length)[None, part]).logits
loss = F.cross_entropy(logits.flatten(0, 1).float(), shifted[:, part].flatten(), ignore_index=-100, reduction="sum")
loss.backward()
grads = {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}
group = {name: grad.clone() for name, grad in grads.items()}
for grad in [*group.values(), total := loss.detach().float().clone()]:
    torch.distributed.all_reduce(grad)
if rank == 0:
    torch.save({"loss": loss.item(), "calls": [list(shape) for shape in calls], "bands": bands, "grads": grads,
                "group_loss": total.item(), "group_grads": group}, out)
torch.distributed.barrier()
