"""Preference pairs and the DPO family's objectives (recipes/dpo.py): TRL's data formats tokenized as TRL does, each
pair's chosen and rejected packed as two documents of one row (never padded, never split), their log-probabilities
from the same chunked head as the SFT loss, and losses kept as sums so that a window of micro batches averages over
its PAIRS exactly, however they fall into rows and processes.

Matched to trl 1.16 (trainer/dpo_trainer.py: _prepare_dataset, DataCollatorForPreference, _compute_loss;
data_utils.py: extract_prompt, common_prefix_length); tests/test_preference.py runs TRL's own trainer on the same
pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import IGNORE, bins
from .loss import per_group, target_losses

PAIR_COLUMNS = ("chosen", "rejected")  # with "prompt", or without (the implicit prompt: their shared start)


def split_prompt(example: dict) -> dict:
    """The implicit prompt (TRL's extract_prompt): the longest shared start of chosen and rejected, as text (a
    space before the split goes with the completions) or as messages; a given prompt is kept."""
    if "prompt" in example and example["prompt"] is not None:
        return example
    chosen, rejected = example["chosen"], example["rejected"]
    at = 0
    for at in range(min(len(chosen), len(rejected))):
        if chosen[at] != rejected[at]:
            if at > 0 and chosen[at - 1] == " ":
                at -= 1
            break
    return {**example, "prompt": chosen[:at], "chosen": chosen[at:], "rejected": rejected[at:]}


def common_prefix(ids: list[int], other: list[int]) -> int:
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return n


def tokenize_pair(example: dict, tokenizer, max_length: int) -> dict:
    """prompt_ids, chosen_ids, rejected_ids as TRL tokenizes them: text completions end with the EOS token (added if
    missing), messages go through the chat template (the prompt with the generation prompt); the completion starts
    where the tokenized prompt and prompt + completion diverge. Each sequence (prompt + completion) is cut to
    max_length keeping its start; `cut`: the completion tokens cut off."""
    example = split_prompt(example)
    prompt, chosen, rejected = example["prompt"], example["chosen"], example["rejected"]
    if isinstance(chosen, str):
        eos = tokenizer.eos_token or ""
        chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
        prompt_ids = tokenizer(text=prompt)["input_ids"]
        full = [tokenizer(text=prompt + c)["input_ids"] for c in (chosen, rejected)]
    else:
        def ids(messages, **kwargs):
            return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]

        prompt_ids = ids(prompt, add_generation_prompt=True)
        full = [ids(prompt + c) for c in (chosen, rejected)]
    start = min(common_prefix(prompt_ids, f) for f in full)
    prompt_ids = prompt_ids[:start]
    room = max(max_length - start, 0)
    completions = [f[start:] for f in full]
    return {"prompt_ids": prompt_ids[:max_length], "chosen_ids": completions[0][:room],
            "rejected_ids": completions[1][:room], "cut": sum(max(len(c) - room, 0) for c in completions)}


def learnable_pair(example: dict) -> bool:
    """Both completions keep a token (TRL drops a pair whose prompt alone fills max_length)."""
    return bool(example["chosen_ids"]) and bool(example["rejected_ids"])


def pair_documents(example: dict) -> list[tuple[list[int], list[int]]]:
    """The pair's two documents, chosen first: (input_ids, labels), the prompt no target, nor a document's first
    token (nothing before it in the row predicts it)."""
    prompt = example["prompt_ids"]
    docs = []
    for completion in (example["chosen_ids"], example["rejected_ids"]):
        ids = prompt + completion
        labels = [IGNORE] * len(prompt) + list(completion)
        docs.append((ids, [IGNORE, *labels[1:]]))
    return docs


def pack_pairs(ds, width: int, packing: bool = True):
    """Rows of whole pairs (bins of their two documents' lengths): input_ids, labels, position_ids (restarting at each
    document), `document` (each token's document in its row, chosen = even, its rejected = the next), the
    documents' completion lengths, and the pairs' `index` in `ds` (their key in a store of reference log-probs).
    packing false: one pair per row."""
    from datasets import Dataset

    pairs = [pair_documents(ex) for ex in ds]
    lengths = [sum(len(ids) for ids, _ in docs) for docs in pairs]
    rows = bins(lengths, width) if packing else [[i] for i in range(len(pairs))]
    out = {"input_ids": [], "labels": [], "position_ids": [], "document": [], "completion_tokens": [], "index": []}
    for row in sorted(rows, key=min):  # (in the order of the data: bins returns the longest first)
        docs = [doc for i in row for doc in pairs[i]]
        out["input_ids"].append([t for ids, _ in docs for t in ids])
        out["labels"].append([t for _, labels in docs for t in labels])
        out["position_ids"].append([p for ids, _ in docs for p in range(len(ids))])
        out["document"].append([d for d, (ids, _) in enumerate(docs) for _ in ids])
        out["completion_tokens"].append([len(ds[i][key]) for i in row for key in ("chosen_ids", "rejected_ids")])
        out["index"].append(list(row))
    return Dataset.from_dict(out)


class PairCollator:
    """Pad rows of packed pairs to the longest (right padding, its own document of position ids); documents numbered
    across the micro batch: document 2k is pair k's chosen, 2k + 1 its rejected. Keeps `ref_logps` when the rows
    carry them (a precomputed reference)."""

    def __init__(self, pad_token_id: int, multiple: int = 1):
        self.pad, self.multiple = pad_token_id, multiple

    def __call__(self, rows: list[dict]) -> dict:
        width = -(-max(len(r["input_ids"]) for r in rows) // self.multiple) * self.multiple
        out = {"input_ids": [], "labels": [], "attention_mask": [], "position_ids": [], "document": []}
        first = 0
        for r in rows:
            gap = width - len(r["input_ids"])
            out["input_ids"].append(r["input_ids"] + [self.pad] * gap)
            out["labels"].append(r["labels"] + [IGNORE] * gap)
            out["attention_mask"].append([1] * len(r["input_ids"]) + [0] * gap)
            out["position_ids"].append(r["position_ids"] + list(range(gap)))
            out["document"].append([first + d for d in r["document"]] + [-1] * gap)
            first += len(r["completion_tokens"])
        batch = {key: torch.tensor(value) for key, value in out.items()}
        batch["completion_tokens"] = torch.tensor([n for r in rows for n in r["completion_tokens"]])
        batch["index"] = torch.tensor([i for r in rows for i in r["index"]])
        if "ref_logps" in rows[0]:
            batch["ref_logps"] = torch.tensor([x for r in rows for x in r["ref_logps"]], dtype=torch.float64)
        return batch


def sequence_logps(model, batch) -> torch.Tensor:
    """Each document's log-probability of its completion (the sum of log p over its target tokens), in fp32: one
    per document of the micro batch, chosen and rejected alternating."""
    losses = target_losses(model, batch)
    return -per_group(losses, batch["labels"], batch["document"].clamp(min=0), batch["completion_tokens"].numel())


def target_counts(batch) -> torch.Tensor:
    """Each document's target tokens (its completion, less a first token that nothing predicts)."""
    labels = batch["labels"]
    ones = torch.ones(int((labels[:, 1:] != IGNORE).sum()), device=labels.device)
    return per_group(ones, labels, batch["document"].clamp(min=0), batch["completion_tokens"].numel())


def pair_losses(loss_type: str, chosen: torch.Tensor, rejected: torch.Tensor, lengths: torch.Tensor, dpo
                ) -> torch.Tensor:
    """One objective per pair, from the policy's log-ratios to the reference (chosen, rejected: log pi - log ref).
    `lengths`: the completions' tokens, [pairs, 2] (IPO averages per token, as TRL does)."""
    delta = chosen - rejected
    if loss_type == "sigmoid":  # DPO (Rafailov et al. 2023)
        return -F.logsigmoid(dpo.beta * delta)
    if loss_type == "hinge":  # SLiC
        return torch.relu(1 - dpo.beta * delta)
    if loss_type == "ipo":  # Azar et al. 2023, eq. 17, on per-token log-ratios (TRL's normalisation)
        per_token = chosen / lengths[:, 0].clamp(min=1) - rejected / lengths[:, 1].clamp(min=1)
        return (per_token - 1 / (2 * dpo.beta)) ** 2
    if loss_type == "robust":  # Chowdhury et al. 2024: unbiased under a label_smoothing share of flipped pairs
        eps = dpo.label_smoothing
        return (-(1 - eps) * F.logsigmoid(dpo.beta * delta) + eps * F.logsigmoid(-dpo.beta * delta)) / (1 - 2 * eps)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def preference_sums(policy: torch.Tensor, reference: torch.Tensor, batch, dpo) -> dict:
    """A micro batch's contribution to its window, as sums (the loop divides by the window's pairs, over every
    process): `pair_loss` (the weighted objectives, summed over pairs), `sft` (the chosen completions' summed
    -log p, for loss_type sft; divided by the window's chosen target tokens), the counts, and TRL's metrics summed
    over pairs (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected).
    policy, reference: sequence_logps, one per document."""
    chosen, rejected = policy[0::2], policy[1::2]
    ratio_chosen, ratio_rejected = chosen - reference[0::2].to(policy.dtype), rejected - reference[1::2].to(policy.dtype)
    lengths = batch["completion_tokens"].view(-1, 2).to(policy.dtype)
    pair_loss, sft = policy.new_zeros(()), policy.new_zeros(())
    for loss_type, weight in zip(dpo.losses, dpo.weights):
        if loss_type == "sft":
            sft = sft + weight * -chosen.sum()
        else:
            pair_loss = pair_loss + weight * pair_losses(loss_type, ratio_chosen, ratio_rejected, lengths, dpo).sum()
    with torch.no_grad():
        rewards_chosen, rewards_rejected = dpo.beta * ratio_chosen, dpo.beta * ratio_rejected
        metrics = {"rewards/chosen": rewards_chosen.sum(), "rewards/rejected": rewards_rejected.sum(),
                   "rewards/accuracies": (rewards_chosen > rewards_rejected).float().sum(),
                   "rewards/margins": (rewards_chosen - rewards_rejected).sum(),
                   "logps/chosen": chosen.sum(), "logps/rejected": rejected.sum()}
    return {"pair_loss": pair_loss, "sft": sft, "pairs": chosen.numel(),
            "chosen_targets": int(target_counts(batch)[0::2].sum()), "metrics": metrics}


def window_loss(sums: dict, pairs: int, chosen_targets: int) -> torch.Tensor:
    """The loss to backward for one micro batch: its sums over the WINDOW's pairs (and chosen target tokens, for the
    sft term), counted over every micro batch and process of the window; the window's gradient is then the mean
    over its pairs, as one batch of all of them would give."""
    loss = sums["pair_loss"] / max(pairs, 1)
    if chosen_targets:
        loss = loss + sums["sft"] / chosen_targets
    return loss
