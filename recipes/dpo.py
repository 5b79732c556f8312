"""Preference tuning (DPO and its family) with a memrecipe recipe: sft.py's loop and setup steps, another
objective.

    memrecipe run dpo --recipe single-gpu-lora
    accelerate launch --config_file accelerate_configs/single_gpu_lora_cpu1.yaml \
        recipes/dpo.py --recipe recipes/single-gpu-lora.yaml [--output-dir DIR] [key=value ...]

The recipe's `dpo:` section holds TRL's keys (beta, loss_type, loss_weights, label_smoothing, simpo_gamma); the
data is TRL's preference formats (prompt / chosen / rejected, as text or messages, or chosen / rejected with the
prompt shared). What differs from sft.py is here: the data (each pair's chosen and rejected packed as two documents
of one row, never split), the reference (never a second model: under LoRA the same weights with the adapters off,
or, on a saved adapter trained on, its frozen copy; for a full fine-tune the initial model's log-probs, computed
before step 1 and kept in the run folder; none for SimPO and ORPO), and the objective's window (`Preference`); the
run, the model, the optimizer, the schedule, the loop and the report are sft.py's own
steps, imported from it (keep the two files side by side).

Accumulation is exact by pairs: every micro batch's loss is its pairs' summed objective divided by the number
of pairs in the whole window over all processes (the sft term, by the window's chosen target tokens), so the
step's gradient is the mean over the window's pairs, however they fall into packed rows and processes.
"""

import time

# first: importing memrecipe quiets library notices that say nothing about the run
from memrecipe.loop import (METRICS, REFERENCE_STORE, PairCollator, embedded_model, frozen_copy,  # isort: skip
                            pair_values, preference_sums, prepare_pairs, reference_store, reference_weights, rows_key,
                            sequence_logps, target_counts, window_loss)
import torch
from torch.utils.data import DataLoader

import sft  # the setup steps, the loop and the finish: recipes/sft.py, beside this file


def setup_pairs(recipe, tokenizer, accelerator, say):
    """Train and eval loaders of packed pairs: tokenized once (main process first), a new seeded shuffle of the rows
    each epoch, whole windows only (as sft.train_loader)."""
    with accelerator.main_process_first():
        train_set, eval_set = prepare_pairs(recipe, tokenizer, say)  # logs pairs kept, dropped, truncated
    collate = PairCollator(tokenizer.pad_token_id)
    train_loader = DataLoader(train_set, batch_size=recipe.per_device_train_batch_size, shuffle=True, drop_last=True,
                              collate_fn=collate, generator=torch.Generator().manual_seed(recipe.seed))
    eval_loader = DataLoader(eval_set, batch_size=recipe.per_device_train_batch_size, collate_fn=collate) \
        if eval_set is not None else None
    return train_loader, eval_loader


class Preference(sft.Objective):
    """The DPO family's objective for sft.train: a window's forward and backward, and an eval, with TRL's metrics.
    The reference's log-probabilities are the model's own with its LoRA adapters off, under no_grad."""

    def __init__(self, recipe):
        super().__init__(recipe)
        self.dpo = recipe.dpo
        # the reference's log-probs computed once before training (a full fine-tune's default: no frozen copy of the
        # model), or beside each micro batch with the adapters off (LoRA's default)
        self.source = recipe.dpo_reference  # none | store | copy | adapter | adapters-off
        self.store = None  # [pairs, 2]: chosen, rejected
        self.frozen = None  # a full fine-tune's reference without the store: a frozen copy of the initial model
        self.adapter = recipe.lora.adapter if recipe.lora else None  # a saved adapter trained on: also the reference

    def start(self, model, train_loader, eval_loader, accelerator, run, say):
        """Before the first step (and before a resumed run loads its checkpoint, so `model` is the initial one):
        the precomputed reference, read from the run folder when it was computed from these rows, else computed
        now and written there."""
        if self.source == "copy":
            self.frozen = frozen_copy(self.recipe, self.recipe.model_name_or_path or embedded_model(), accelerator)
            self.held.append(self.frozen)
        if self.source != "store":
            return
        datasets = [train_loader.dataset, eval_loader.dataset if eval_loader is not None else None]
        key = rows_key(*datasets, model=self.recipe.model_name_or_path or "embedded", adapter=self.adapter,
                       precision=accelerator.mixed_precision)
        path = run.path / REFERENCE_STORE
        saved = torch.load(path, weights_only=True) if path.is_file() else None
        if saved is not None and saved["key"] == key:
            self.store = saved["logps"]
            say(f"reference: {len(self.store):,} pairs' log-probs read from {path.name} (computed for these rows)")
            return
        tick = time.perf_counter()
        with reference_weights(accelerator.unwrap_model(model)):
            self.store = reference_store(model, datasets, train_loader.collate_fn, accelerator,
                                         self.recipe.per_device_train_batch_size)
        if accelerator.is_main_process:
            torch.save({"key": key, "logps": self.store}, path)
        accelerator.wait_for_everyone()
        say(f"reference: {len(self.store):,} pairs' log-probs computed in {time.perf_counter() - tick:.1f} s"
            + (" (the rows changed since the run folder's were computed)" if saved is not None else "")
            + f", kept in {path.name}")

    def describe(self) -> str:
        d = self.dpo
        return (f"dpo: {' + '.join(f'{w:g} x {t}' for t, w in zip(d.losses, d.weights))}, beta {d.beta:g}"
                + (f", label_smoothing {d.label_smoothing:g}" if d.label_smoothing else "")
                + (f", simpo_gamma {d.gamma:g}" if d.reads("simpo_gamma") else "")
                + "; reference: " + {
                    "none": "none (a reference-free objective: no reference pass)",
                    "store": "its log-probs precomputed before the first step",
                    "copy": "a frozen copy of the initial model, beside each micro batch",
                    "adapter": "the saved adapter's frozen copy, beside each micro batch",
                    "adapters-off": "the base with the adapters off, beside each micro batch"}[self.source])

    @torch.no_grad()
    def reference(self, model, batch, accelerator):
        if self.dpo.reference_free:
            return None
        if self.store is not None:  # precomputed: looked up by the pairs' index
            return self.store[batch["index"].cpu()].flatten().to(accelerator.device)
        if self.frozen is not None:  # not prepared by accelerate: its mixed precision, as the policy's forward runs
            with accelerator.autocast():
                return sequence_logps(self.frozen, batch)
        with reference_weights(accelerator.unwrap_model(model)):
            return sequence_logps(model, batch)

    def window(self, model, window, accelerator) -> dict:
        """Forward and backward over the window's micro batches; returns the window's mean loss per pair, its target
        tokens, pairs, and TRL's metrics averaged over its pairs (all processes)."""
        counts = [target_counts(b) for b in window]  # each document's target tokens
        local = torch.tensor([[b["completion_tokens"].numel() // 2, int(c[0::2].sum()), int(c.sum())]
                              for b, c in zip(window, counts)]).sum(0)
        pairs, chosen_targets, targets = accelerator.reduce(local.to(accelerator.device), "sum").tolist()
        # accelerate divides each micro batch's loss by the accumulation steps and DDP averages over processes
        scale = accelerator.num_processes * accelerator.gradient_accumulation_steps
        totals = {}
        for batch in window:
            reference = self.reference(model, batch, accelerator)
            with accelerator.accumulate(model):  # no gradient sync until the window's last micro batch
                sums = preference_sums(sequence_logps(model, batch), reference, batch, self.dpo)
                loss = window_loss(sums, pairs, chosen_targets)
                accelerator.backward(loss * scale)
            for name, value in [("loss", loss.detach()), *sums["metrics"].items()]:
                totals[name] = totals.get(name, 0) + value
        names = list(totals)
        summed = accelerator.reduce(torch.stack([totals[n].float() for n in names]), "sum").tolist()
        out = dict(zip(names, summed))
        return {"loss": out.pop("loss"), "targets": targets, "pairs": pairs,
                **{name: value / pairs for name, value in out.items()}}

    @torch.no_grad()
    def evaluate(self, model, dataloader, accelerator) -> dict:
        """The eval pairs' mean loss and TRL's metrics as eval_*, each pair once over all processes: summed per row,
        the rows gathered (gather_for_metrics drops the rows that even out the last batch across processes)."""
        names = ("loss", "sft", "chosen_targets", *METRICS)
        model.eval()
        totals = torch.zeros(len(names) + 1, device=accelerator.device)
        for batch in dataloader:
            values = pair_values(sequence_logps(model, batch), self.reference(model, batch, accelerator), batch,
                                 self.dpo)
            pairs = torch.stack([values[name].float() for name in names] + [torch.ones_like(values["loss"])], 1)
            rows = pairs.new_zeros(batch["input_ids"].shape[0], pairs.shape[1]).index_add_(0, batch["pair_row"], pairs)
            totals = totals + accelerator.gather_for_metrics(rows).sum(0)
        model.train()
        total = dict(zip((*names, "pairs"), totals.tolist()))
        loss = window_loss({"pair_loss": total["loss"], "sft": total["sft"]}, total["pairs"], total["chosen_targets"])
        return {"eval_loss": float(loss), **{f"eval_{name}": total[name] / total["pairs"] for name in METRICS}}


def main(argv=None):
    sft.main(argv, script="dpo", setup_data=setup_pairs, objective=Preference)  # sft.py's steps, this data and loss


if __name__ == "__main__":
    sft.entry(main)
