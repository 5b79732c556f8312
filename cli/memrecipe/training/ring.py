"""Ring attention on the loop's side (parallelism.cp_size): torch's context_parallel, which accelerate prepares on
FSDP2 (Accelerator._prepare_cp: hooks that drop each attention's mask and make it causal) and enters per micro batch
(Accelerator.maybe_context_parallel). Inside it, each process keeps its slice of a row's sequence tensors, the
slices cut by torch's head-tail load balancer (2 x cp chunks, a process taking one from each end, so the causal
work is even), and torch replaces SDPA's CUDA kernels with ring ones that pass keys and values around the group.

What is memrecipe's here: which tensors are cut (the token ids, their positions for the rotary embedding, and each
position's target, shifted before the cut so a slice's last token keeps its target), the targets counted once per
ring (its processes hold one batch between them: accelerate's loader gives a ring one batch, as a TP group), and the
one-line refusals. CUDA only: torch replaces no CPU kernel, so on CPU each process would attend within its own
slice (a wrong result, not an error)."""

from __future__ import annotations

import contextlib

from ..errors import RecipeError
from .loss import RING_SLICE, next_tokens
from .sequence import sp_size


class Ring:
    """The launch config's ring (size 1: none), each micro batch's slices, and the rows' length multiple."""

    def __init__(self, accelerator):
        config = getattr(accelerator, "parallelism_config", None)
        self.accelerator = accelerator
        self.size = config.cp_size if config is not None and config.cp_enabled else 1

    @property
    def row_multiple(self) -> int:
        """What each row's length is padded to a multiple of when its sequence is split (the Collator also gives such
        rows their positions): ring attention's 2 x cp (torch's load balancer cuts 2 x cp equal chunks), Ulysses' sp
        (equal slices); 1: no split."""
        return 2 * self.size if self.size > 1 else sp_size(self.accelerator)

    @contextlib.contextmanager
    def shards(self, batch: dict):
        """A context for one micro batch's forward and backward, giving the batch to compute on: this process's slice
        of its token ids, their positions (the rotary embedding's) and each position's target (shifted before the
        cut, so a slice's last token keeps its target), with the ring kernels on; the batch itself without a ring.
        The slices are cut from copies: the loop's window keeps whole batches for its counts."""
        if self.size == 1:
            yield batch
            return
        sliced = {"input_ids": batch["input_ids"].clone(), "position_ids": batch["position_ids"].clone(),
                  "shift_labels": next_tokens(batch).clone()}  # (no mask: accelerate drops it, each row is causal)
        cut = list(sliced.values())
        with self.accelerator.maybe_context_parallel(buffers=cut, buffer_seq_dims=[1] * len(cut),
                                                     no_restore_buffers=set(cut)):
            yield sliced | {RING_SLICE: True}  # (no [S x S] mask for the positions' jump: loss.RING_SLICE)


def check_ring(accelerator, recipe) -> int:
    """The launch config's ring against the recipe's, on CUDA under FSDP2; returns its size."""
    cp, asked = Ring(accelerator).size, recipe.context_parallel
    if cp != asked:
        raise RecipeError(f"the recipe splits each sequence over {asked} process(es) by ring attention "
                          f"(parallelism.cp_size={asked}), the launch config over {cp}: regenerate it with memrecipe "
                          "config (or use memrecipe run)")
    if cp > 1 and accelerator.device.type != "cuda":
        raise RecipeError(f"ring attention (parallelism.cp_size={cp}) runs on CUDA only: torch's context_parallel "
                          "replaces SDPA's CUDA kernels (flash, efficient, cudnn) and no CPU one, so each process would "
                          "attend within its own slice; zero3-ulysses splits sequences on CPU")
    return cp
