"""What one process of a Ulysses group holds, launched on 2 gloo processes (torchrun): the model as the loop builds it
(tests/helpers.loop_model) with DeepSpeed's Ulysses attention registered as accelerate's prepare registers it, and one
sequence of each length cut into the group's slices as DeepSpeed's adapter cuts it (labels shifted first). For each
length, rank 0 writes the bytes the forward leaves for backward and the step's peak beside the weights and their
gradients (no ZeRO: parameters whole, so the bytes are the activations'), after one step that allocates what is
allocated once. The forward's bytes are
tests/measuring.py's; the step's peak is read off the profiler's allocations in time order (its memory timeline, which
the test on one process reads by category, refuses collectives' in-place writes), less the trained gradients' bytes.

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/ulysses_bytes.py OUT.json MODEL L1,L2 [key=value ...]
"""

import gc
import json
import sys

import deepspeed
import torch
from torch.nn import functional as F

import memrecipe  # noqa: F401  (quiets library notices, as the loop does)
from helpers import loop_model
from measuring import _step, held_after_forward
from memrecipe.planning.registry import load_recipe

out, model_path, lengths, words = sys.argv[1], sys.argv[2], [int(n) for n in sys.argv[3].split(",")], sys.argv[4:]
deepspeed.init_distributed("gloo")
rank, sp = torch.distributed.get_rank(), torch.distributed.get_world_size()
recipe = load_recipe("zero3-ulysses", words)
model, _ = loop_model(recipe, model_path, "bf16", engine="DEEPSPEED")  # (the tiled MLPs agree on their tile counts)
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF  # noqa: E402

UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
                                                micro_batch_size=1, seq_length_is_variable=True, disable_in_eval=True)
model.train()
grads = sum(4 * p.numel() for p in model.parameters() if p.requires_grad)  # (LoRA's adapters: fp32)


def timeline_peak(step) -> int:
    """The most bytes `step()` allocated and held at once (the profiler's [memory] events in time order)."""
    gc.collect()
    gc.disable()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        gc.enable()
    now = peak = 0
    for event in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns()):
        now += event.nbytes()
        peak = max(peak, now)
    return peak


measured = {}
for length in [lengths[0], *lengths]:  # the first, twice: what its first step allocates once (gloo, the exchanges) is no
    # bytes per token
    ids = torch.randint(4, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    shifted = F.pad(ids, (0, 1), value=-100)[:, 1:]  # ulysses_sp.py, UlyssesSPDataLoaderAdapter.refill
    part = slice(rank * length // sp, (rank + 1) * length // sp)
    batch = {"input_ids": ids[:, part], "shift_labels": shifted[:, part], "attention_mask": torch.ones_like(ids[:, part]),
             "position_ids": torch.arange(length)[None, part]}
    held = held_after_forward(model, batch, autocast=True)[1]
    model.zero_grad(set_to_none=True)
    peak = timeline_peak(lambda: _step(model, batch, autocast=True)) - grads
    model.zero_grad(set_to_none=True)
    measured[length] = {"forward_saved": held, "working": peak}
if rank == 0:
    with open(out, "w") as f:
        json.dump(measured, f)
torch.distributed.barrier()
