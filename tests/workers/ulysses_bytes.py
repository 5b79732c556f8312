"""What one process of a Ulysses group holds between forward and backward, launched on 2 gloo processes (torchrun):
the model as the loop builds it (tests/helpers.loop_model) with DeepSpeed's Ulysses attention registered as
accelerate's prepare registers it, and one sequence of each length cut into the group's slices as DeepSpeed's adapter
cuts it (labels shifted first). Rank 0 writes, for each length, the bytes of the tensors autograd keeps for backward
when the forward ends (tests/measuring.py, saved_at_forward_end: each storage once, parameters left out; counted
off autograd's own hooks, so the same in every run, where the profiler's allocations under gloo are not).

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/ulysses_bytes.py OUT.json MODEL L1,L2 [key=value ...]
"""

import json
import sys

import deepspeed
import torch
from torch.nn import functional as F

import memrecipe  # noqa: F401  (quiets library notices, as the loop does)
from helpers import loop_model
from measuring import saved_at_forward_end
from memrecipe.planning.registry import load_recipe
from memrecipe.training.cpu_matmul import bf16_matmuls_in_fp32

out, model_path, lengths, words = sys.argv[1], sys.argv[2], [int(n) for n in sys.argv[3].split(",")], sys.argv[4:]
deepspeed.init_distributed("gloo")
bf16_matmuls_in_fp32()  # as the loop computes on this CPU
rank, sp = torch.distributed.get_rank(), torch.distributed.get_world_size()
recipe = load_recipe("zero3-ulysses", words)
model, _ = loop_model(recipe, model_path, "bf16", engine="DEEPSPEED")  # (the tiled MLPs agree on their tile counts)
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF  # noqa: E402

UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
                                                micro_batch_size=1, seq_length_is_variable=True, disable_in_eval=True)
model.train()
measured = {}
for length in lengths:
    ids = torch.randint(4, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    shifted = F.pad(ids, (0, 1), value=-100)[:, 1:]  # ulysses_sp.py, UlyssesSPDataLoaderAdapter.refill
    part = slice(rank * length // sp, (rank + 1) * length // sp)
    batch = {"input_ids": ids[:, part], "shift_labels": shifted[:, part], "attention_mask": torch.ones_like(ids[:, part]),
             "position_ids": torch.arange(length)[None, part]}
    # (DeepSpeed's bf16 engine computes without autocast: accelerate's native_amp is off under it)
    measured[length] = {"forward_saved": saved_at_forward_end(model, batch, autocast=False)}
    model.zero_grad(set_to_none=True)
if rank == 0:
    with open(out, "w") as f:
        json.dump(measured, f)
torch.distributed.barrier()
