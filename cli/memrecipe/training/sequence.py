"""Ulysses sequence parallelism on the loop's side: the group's size, and the train loader that hands each process its
slice of every sequence.

accelerate's prepare registers DeepSpeed's UlyssesSPAttentionHF (the attention sees whole sequences for 1/sp of the
heads, through two all-to-alls) when the launch config's parallelism_config names sp_backend deepspeed; the data is
sliced by DeepSpeed's UlyssesSPDataLoaderAdapter, which gathers one batch from each process of the group, shifts the
labels (`shift_labels`: the target of a slice's last token is the next slice's first) and gives process r slice r of
each. What is memrecipe's here: a new adapter per epoch and on resume (the adapter keeps one iterator of the loader it
wraps, so the loop's set_epoch and skip would not reach it), and the slices moved to the device (the adapter leaves
them in host memory)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..errors import RecipeError
from ..planning.architecture import layer_windows, reached_windows
from ..planning.attention import dropped_window_note
from ..planning.topology import check_heads
from .data import IGNORE


def sp_size(accelerator) -> int:
    """The sequence-parallel group's size the launch config set (1: none)."""
    config = accelerator.parallelism_config
    return config.sp_size if config is not None and config.sp_backend == "deepspeed" else 1


def check_sequence_parallel(accelerator, recipe, config) -> int:
    """The launch config's sp size, checked against the recipe's and the model's heads (`config`: the model's);
    returns it."""
    sp, asked = sp_size(accelerator), recipe.sequence_group(accelerator.num_processes)
    if sp != asked:
        raise RecipeError(f"the recipe splits each sequence over {asked} process(es) (parallelism.sp_size="
                          f"{recipe.sequence_parallel or 'null: all of them'}), the launch config over {sp}: regenerate "
                          "it with memrecipe config (or use memrecipe run)")
    if sp > 1 and accelerator.distributed_type.value != "DEEPSPEED":
        raise RecipeError("sequence parallelism (the launch config's parallelism_config_sp_size) runs on DeepSpeed "
                          "only: launch with a DeepSpeed config")
    if sp > 1:
        text = config.get_text_config()
        check_heads(sp, text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        reached = reached_windows(layer_windows(text.to_dict()), recipe.max_seq_length)
        if dropped := dropped_window_note(config._attn_implementation, sp, reached, text.model_type,
                                           recipe.query_chunks):
            raise RecipeError(dropped)
    return sp


class SequenceShards:
    """The train loader under Ulysses: micro batch i of process r is slice r of the i-th batch the group draws (one
    from each process in turn), so an epoch is sp times as many micro batches, each 1/sp as long. Micro batch x
    accumulation x (processes / sp) sequences make a step."""

    def __init__(self, loader, accelerator, model):
        self.loader, self.accelerator, self.model, self.sp = loader, accelerator, model, sp_size(accelerator)

    @property
    def dataset(self):
        return self.loader.dataset

    def __len__(self):
        return len(self.loader) * self.sp

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self):
        return self.skip(0)

    def skip(self, consumed: int):
        """The micro batches from the `consumed`-th on (a resumed epoch): whole draws of the group skipped in the loader,
        the rest of a draw's slices dropped here."""
        from deepspeed.utils import groups

        drawn, into = divmod(consumed, self.sp)
        loader = self.accelerator.skip_first_batches(self.loader, drawn) if drawn else self.loader
        group = groups._get_sequence_parallel_group()  # (the one accelerate's adapter call reads)
        if torch.distributed.get_backend(group) == "gloo":
            loader = EvenLengths(loader, group)
        device = self.accelerator.device
        for i, batch in enumerate(self.accelerator.deepspeed_ulysses_dl_adapter(loader, self.model)):
            if i >= into:
                yield {k: v.to(device, non_blocking=True) if hasattr(v, "to") else v for k, v in batch.items()}


class EvenLengths:
    """A loader whose batches are padded to the longest of the group's: the adapter all-gathers each process's batch,
    and gloo gathers equal shapes only (NCCL takes uneven ones). The padding goes after every real token, so under
    causal attention nothing real sees it, and it is no target: the loss is unchanged."""

    def __init__(self, loader, group):
        self.loader, self.group = loader, group

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            width = torch.tensor(batch["input_ids"].shape[1])
            torch.distributed.all_reduce(width, op=torch.distributed.ReduceOp.MAX, group=self.group)
            gap = int(width) - batch["input_ids"].shape[1]
            if gap:
                last = batch["position_ids"][:, -1:]
                batch = {**batch, "input_ids": F.pad(batch["input_ids"], (0, gap)),  # (any id: nothing reads it)
                         "labels": F.pad(batch["labels"], (0, gap), value=IGNORE),
                         "attention_mask": F.pad(batch["attention_mask"], (0, gap)),
                         "position_ids": torch.cat([batch["position_ids"], last + torch.arange(1, gap + 1, device=last.device)], dim=1)}
            yield batch


def skip_batches(accelerator, loader, consumed: int):
    """The train loader from micro batch `consumed` of the epoch on: a resumed run's first epoch."""
    if not consumed:
        return loader
    return loader.skip(consumed) if isinstance(loader, SequenceShards) else accelerator.skip_first_batches(loader, consumed)
