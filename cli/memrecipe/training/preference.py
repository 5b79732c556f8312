"""Preference pairs and the DPO family's objectives (recipes/dpo.py): TRL's data formats tokenized as TRL does, each
pair's chosen and rejected packed as two documents of one row (never padded, never split), their log-probabilities
from the same chunked head as the SFT loss, and losses kept as sums so that a window of micro batches averages over
its PAIRS exactly, however they fall into rows and processes.

Matched to trl 1.16 (trainer/dpo_trainer.py: _prepare_dataset, DataCollatorForPreference, _compute_loss;
data_utils.py: extract_prompt, common_prefix_length); tests/unit/training/test_preference.py runs TRL's own trainer on the same
pairs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset as TorchDataset

from ..planning.recipe import PREFERENCE_LOSSES
from .data import IGNORE, bins
from .loss import per_group, target_losses

PAIR_COLUMNS = ("chosen", "rejected")  # with "prompt", or without (the implicit prompt: their shared start)


def split_prompt(example: dict) -> dict:
    """The implicit prompt (TRL's extract_prompt): the longest shared start of chosen and rejected, as text (a
    space before the split goes with the completions) or as messages; a given prompt of the completions' kind is
    kept. A text prompt beside full conversations (UltraFeedback's layout, which repeats it as their first turn) is
    left aside for the turns they share, as TRL's maybe_extract_prompt does."""
    prompt = example.get("prompt")
    if prompt is not None and isinstance(prompt, str) == isinstance(example["chosen"], str):
        return example
    chosen, rejected = example["chosen"], example["rejected"]
    at = 0
    for at in range(min(len(chosen), len(rejected))):
        if chosen[at] != rejected[at]:
            if at > 0 and chosen[at - 1] == " ":
                at -= 1
            break
    return {**example, "prompt": chosen[:at], "chosen": chosen[at:], "rejected": rejected[at:]}


def load_pairs(spec, recipe, name: str):
    """The preference rows of `dataset` (name "train") or `eval_dataset` ("eval"): each source (None: the embedded
    preference set) loaded, its fraction drawn with the seed, checked for TRL's columns (chosen and rejected, with
    or without prompt); several are shuffled together."""
    from datasets import concatenate_datasets

    from ..errors import RecipeError
    from ..planning.registry import EMBEDDED_PREFERENCES
    from .data import load_any, map_columns, sources

    parts = []
    for i, source in enumerate(sources(spec)):
        where = f"{name} dataset[{i}] ({source.path}): " if isinstance(spec, tuple) else f"{name} dataset: "
        raw = map_columns(load_any(source.path or str(EMBEDDED_PREFERENCES), source.split), source.columns, where)
        missing = [c for c in PAIR_COLUMNS if c not in raw.column_names]
        if missing:
            raise RecipeError(f"{where}preference tuning needs columns chosen and rejected (and prompt, or a prompt "
                              f"shared by both); it has no {' or '.join(missing)}: {', '.join(raw.column_names)} "
                              "(map yours with a dataset entry's columns:, e.g. chosen: response_a)")
        raw = raw.select_columns([c for c in ("prompt", *PAIR_COLUMNS) if c in raw.column_names])
        for column in PAIR_COLUMNS:  # a row without one (a JSON line that lacks the key reads as null)
            empty = next((n for n, value in enumerate(raw[column]) if value is None
                          or isinstance(value, (str, list)) and len(value) == 0), None)
            if empty is not None:
                raise RecipeError(f"{where}row {empty + 1} has no {column}: every pair needs chosen and rejected")
        if len(raw) and all(c == r for c, r in zip(raw["chosen"], raw["rejected"])):
            raise RecipeError(f"{where}chosen equals rejected in every row: nothing to prefer")
        check_pairs(raw, where)
        if source.fraction < 1:
            raw = raw.shuffle(seed=recipe.seed).select(range(max(1, int(source.fraction * len(raw)))))
        parts.append(raw)
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts).shuffle(seed=recipe.seed)


def prepare_pairs(recipe, tokenizer, say=None) -> tuple[TorchDataset, TorchDataset | None]:
    """(train, eval or None): tokenized pairs packed into rows (pack_pairs), as the recipe asks. `say` gets a line
    per split: pairs kept, dropped (the completions cut away by max_length), truncated, tokens, rows."""
    from ..errors import RecipeError
    from .data import fingerprint, held_out

    say = say or (lambda *a, **k: None)
    max_length = recipe.dpo.max_length or recipe.max_seq_length // 2
    train = load_pairs(recipe.dataset, recipe, "train")
    eval_raw = load_pairs(recipe.eval_dataset, recipe, "eval") if recipe.eval_dataset else None
    if eval_raw is None and recipe.eval_size:
        train, eval_raw = held_out(train, recipe)

    def finish(raw, name, first=0):
        options = {"tokenizer": tokenizer, "max_length": max_length}
        ds = raw.map(tokenize_pair, fn_kwargs=options, remove_columns=raw.column_names,
                     new_fingerprint=fingerprint(raw, options, tokenize_pair, split_prompt, as_messages))
        kept = ds.filter(learnable_pair)
        if len(kept) == 0:
            raise RecipeError(f"no {name} pair keeps a completion token within dpo.max_length={max_length} (all "
                              f"{len(ds)} dropped): raise max_length (and max_seq_length), or shorten the prompts")
        cut = [n for n in kept["cut"] if n]
        rows = pack_pairs(kept.remove_columns("cut"), recipe.max_seq_length, recipe.packing, first)
        tokens = sum(len(ids) for ids in rows["input_ids"])
        say(f"data: {name}: {len(kept):,} pairs kept"
            + (f", {len(ds) - len(kept)} dropped (the prompt fills dpo.max_length={max_length})" if len(kept) < len(ds)
               else "") + (f", {len(cut)} truncated to {max_length} tokens a sequence ({sum(cut):,} cut)" if cut else "")
            + f"; {tokens:,} tokens in {len(rows):,} rows of <= {recipe.max_seq_length}"
            + (f", {tokens / (len(rows) * recipe.max_seq_length):.0%} full" if recipe.packing else ", one pair each"))
        return rows

    train_rows = finish(train, "train")
    pairs = sum(len(index) for index in train_rows["index"])
    return train_rows, finish(eval_raw, "eval", pairs) if eval_raw is not None else None  # pyright: ignore[reportReturnType]  (map-style)


REFERENCE_STORE = "reference_logps.pt"  # in the run folder: the reference's log-probs, one [chosen, rejected] per pair


def rows_key(*datasets, **inputs) -> str:
    """What a store of reference log-probs was computed from: the packed rows' tokens and pair indices, and `inputs`
    (the model, the precision)."""
    import hashlib

    import numpy as np

    digest = hashlib.sha256(repr(sorted(inputs.items())).encode())
    for ds in datasets:
        if ds is not None:
            for column in ("input_ids", "index"):
                digest.update(np.concatenate([np.asarray(x, dtype=np.int64) for x in ds[column]]).tobytes())
    return digest.hexdigest()


@torch.no_grad()
def reference_store(model, datasets, collate, accelerator, batch_size: int) -> torch.Tensor:
    """The reference's log-probabilities of every pair of `datasets` (packed rows), [pairs, 2] in fp64, computed once
    by `model` as it is now (before training; under LoRA with the adapters off), each process a share of the rows,
    gathered on every process."""
    from torch.utils.data import DataLoader

    pairs = sum(len(index) for ds in datasets if ds is not None for index in ds["index"])
    store = torch.full((pairs, 2), float("nan"), dtype=torch.float64)
    was_training = model.training
    model.eval()
    for ds in datasets:
        if ds is None:
            continue
        loader = accelerator.prepare_data_loader(DataLoader(ds, batch_size=batch_size, collate_fn=collate))
        for batch in loader:
            logps = sequence_logps(model, batch).view(-1, 2).double()
            # the processes' batches differ in pairs: padded to the most, then gathered (the copies that even out the
            # last batch across processes write the same values again)
            index = accelerator.pad_across_processes(batch["index"], dim=0, pad_index=-1)
            logps = accelerator.pad_across_processes(logps, dim=0)
            index, logps = accelerator.gather(index).cpu(), accelerator.gather(logps).cpu()
            store[index[index >= 0]] = logps[index >= 0]
    model.train(was_training)
    assert not store.isnan().any(), "a pair's reference log-probs were not computed"
    return store


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
    example = split_prompt(as_messages(example))
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


def as_messages(example: dict, where: str = "") -> dict:
    """A pair with its conversations as the chat template takes them (data.conversation: ShareGPT's turns and role
    names mapped); text as it is; anything else one line naming the column."""
    from ..errors import RecipeError
    from .data import _kind, conversation

    out = dict(example)
    for column in ("prompt", *PAIR_COLUMNS):
        value = example.get(column)
        if value is None and column == "prompt" or isinstance(value, str):
            continue
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{where}{column} is {_kind(value)}: give text, or a list of {{role, content}} messages")
        out[column] = conversation(value, f"{where}{column}: ")
    return out


def check_pairs(raw, where: str = "") -> None:
    """Every pair's columns are text or conversations (one line naming the row and what is wrong), and some pair
    has a prompt: given, or the start chosen and rejected share (without one, nothing conditions the preference)."""
    from ..errors import RecipeError

    prompted = False
    for n, row in enumerate(raw, 1):
        pair = split_prompt(as_messages(row, f"{where}row {n}: "))
        prompted = prompted or len(pair["prompt"]) > 0
    if not prompted:
        raise RecipeError(f"{where}no pair has a prompt: give a prompt column, or chosen and rejected that start with "
                          "the same prompt (text, or the same first turns)")


def check_pair_lengths(raw, tokenizer, recipe, where: str = "", sample: int = 256) -> None:
    """Refuse, before launch, pairs none of whose first `sample` keeps a completion token within dpo.max_length (the
    loop would drop them all)."""
    from transformers.utils import logging as hf_logging

    from ..errors import RecipeError

    max_length = recipe.dpo.max_length or recipe.max_seq_length // 2
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notice that a text is longer than the model's maximum: the point here
    try:
        rows = raw.select(range(min(sample, len(raw))))
        if any(learnable_pair(tokenize_pair(row, tokenizer, max_length)) for row in rows):
            return
    finally:
        hf_logging.set_verbosity(verbosity)
    raise RecipeError(f"{where}no pair of {'its' if len(rows) == len(raw) else 'its first'} {len(rows)} keeps a "
                      f"completion token within dpo.max_length={max_length} (the prompt alone fills it): raise "
                      f"dpo.max_length (and max_seq_length to twice it), or shorten the prompts")


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


def pack_pairs(ds, width: int, packing: bool = True, first: int = 0):
    """Rows of whole pairs (bins of their two documents' lengths): input_ids, labels, position_ids (restarting at each
    document), `document` (each token's document in its row, chosen = even, its rejected = the next), the
    documents' completion lengths, and the pairs' `index` in `ds` plus `first` (their key in a store of reference
    log-probs: the eval pairs' follow the train pairs'). packing false: one pair per row."""
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
        out["index"].append([first + i for i in row])
    return Dataset.from_dict(out)


class PairCollator:
    """Pad rows of packed pairs to the longest (right padding, its own document of position ids); documents numbered
    across the micro batch: document 2k is pair k's chosen, 2k + 1 its rejected, in row `pair_row[k]`."""

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
        batch["pair_row"] = torch.tensor([n for n, r in enumerate(rows) for _ in r["index"]])  # each pair's row
        return batch


@contextlib.contextmanager
def reference_weights(model):
    """The reference model within the policy's own weights, for a no_grad pass: a saved adapter's frozen copy made
    the active one (an adapter trained on, `adapters.add_lora`; TRL's ref_adapter_name), the adapters off (LoRA),
    or the model as it is (a full fine-tune, before its first step). `model` unwrapped (peft's PeftModel).

    peft switches adapters by setting requires_grad (off for the adapters it disables): the flags are put back at
    once, inside the switch. FSDP2 fixes each unit's gradient dtype at its first forward from the parameters that
    require grad then, and DPO's first forward is this one: with no trainable parameter seen, a unit under bf16
    mixed precision would hand its fp32 adapters bf16 gradients (a RuntimeError in its post-backward). Under
    no_grad the flags change nothing in this pass."""
    from .adapters import REFERENCE_ADAPTER

    trains = {p: p.requires_grad for p in model.parameters()}

    def restore():
        for p, flag in trains.items():
            p.requires_grad_(flag)

    with contextlib.ExitStack() as switched:
        switched.callback(restore)  # (last, after the switch back: peft's set_adapter sets the flags again)
        if REFERENCE_ADAPTER in getattr(model, "peft_config", {}):
            model.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
            switched.callback(model.set_adapter, "default")
        elif hasattr(model, "disable_adapter"):
            switched.enter_context(model.disable_adapter())
        restore()
        yield


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


def _ipo(chosen, rejected, lengths, dpo):  # on per-token log-ratios (TRL's normalisation), Azar et al. eq. 17
    per_token = chosen / lengths[:, 0].clamp(min=1) - rejected / lengths[:, 1].clamp(min=1)
    return (per_token - 1 / (2 * dpo.beta)) ** 2


def _robust(chosen, rejected, lengths, dpo):  # unbiased under a label_smoothing share of flipped pairs
    delta, eps = chosen - rejected, dpo.label_smoothing
    return (-(1 - eps) * F.logsigmoid(dpo.beta * delta) + eps * F.logsigmoid(-dpo.beta * delta)) / (1 - 2 * eps)


# The objectives with a reference (PREFERENCE_LOSSES' reference True), one per pair, from the policy's log-ratios
# to the reference (chosen, rejected: log pi - log ref); `lengths`: the completions' tokens, [pairs, 2].
PAIR_LOSSES = {
    "sigmoid": lambda chosen, rejected, lengths, dpo: -F.logsigmoid(dpo.beta * (chosen - rejected)),
    "ipo": _ipo,
    "hinge": lambda chosen, rejected, lengths, dpo: torch.relu(1 - dpo.beta * (chosen - rejected)),
    "robust": _robust,
}


def _simpo(chosen, rejected, dpo):  # a margin over length-normalised rewards
    logits = chosen - rejected - dpo.gamma / dpo.beta
    eps = dpo.label_smoothing
    return -(1 - eps) * F.logsigmoid(dpo.beta * logits) - eps * F.logsigmoid(-dpo.beta * logits)


def _orpo(chosen, rejected, dpo):  # the log odds ratio (the chosen NLL is added beside it: chosen_nll)
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    return -dpo.beta * F.logsigmoid(log_odds)


# The reference-free objectives (reference False), one per pair, from the policy's mean log-probability per
# completion token (chosen, rejected), as trl.experimental's CPOTrainer (simpo) and ORPOTrainer compute them.
FREE_LOSSES = {"simpo": _simpo, "orpo": _orpo}


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (branching at -ln 2)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")  # TRL's names


def pair_values(policy: torch.Tensor, reference: torch.Tensor | None, batch, dpo) -> dict:
    """Per pair of the micro batch: `loss` (the weighted objectives other than the chosen NLL), `sft` (the weighted
    -log p of the chosen completion: loss_type sft, and orpo's own), `chosen_targets`, and TRL's metrics (METRICS).
    policy, reference: sequence_logps, one per document (chosen, rejected alternating); reference None for the
    reference-free objectives (FREE_LOSSES), whose rewards and logps are per completion token, as TRL's."""
    chosen, rejected = policy[0::2], policy[1::2]
    lengths = batch["completion_tokens"].view(-1, 2).to(policy.dtype)
    if reference is None:  # (TRL's CPO and ORPO average the log-probs over the completion's tokens)
        chosen, rejected = chosen / lengths[:, 0].clamp(min=1), rejected / lengths[:, 1].clamp(min=1)
    else:
        chosen_ratio, rejected_ratio = chosen - reference[0::2].to(policy.dtype), rejected - reference[1::2].to(policy.dtype)
    loss, sft = torch.zeros_like(chosen), torch.zeros_like(chosen)
    for loss_type, weight in zip(dpo.losses, dpo.weights):
        if PREFERENCE_LOSSES[loss_type].chosen_nll:
            sft = sft + weight * -policy[0::2]  # summed here; the window divides by its chosen target tokens
        if loss_type in FREE_LOSSES:
            loss = loss + weight * FREE_LOSSES[loss_type](chosen, rejected, dpo)
        elif loss_type in PAIR_LOSSES:
            loss = loss + weight * PAIR_LOSSES[loss_type](chosen_ratio, rejected_ratio, lengths, dpo)
    with torch.no_grad():
        rewards_chosen, rewards_rejected = ((chosen, rejected) if reference is None else
                                            (chosen_ratio, rejected_ratio))
        rewards_chosen, rewards_rejected = dpo.beta * rewards_chosen, dpo.beta * rewards_rejected
        metrics = dict(zip(METRICS, (rewards_chosen, rewards_rejected, (rewards_chosen > rewards_rejected).float(),
                                     rewards_chosen - rewards_rejected, chosen, rejected)))
    return {"loss": loss, "sft": sft, "chosen_targets": target_counts(batch)[0::2], **metrics}


def preference_sums(policy: torch.Tensor, reference: torch.Tensor | None, batch, dpo) -> dict:
    """A micro batch's contribution to its window, as sums (the loop divides by the window's pairs, over every
    process): `pair_loss` (the weighted objectives, summed over pairs), `sft` (the chosen completions' summed
    -log p, for loss_type sft; divided by the window's chosen target tokens), the counts, and TRL's metrics summed
    over pairs."""
    values = pair_values(policy, reference, batch, dpo)
    return {"pair_loss": values["loss"].sum(), "sft": values["sft"].sum(), "pairs": values["loss"].numel(),
            "chosen_targets": int(values["chosen_targets"].sum()),
            "metrics": {name: values[name].sum() for name in METRICS}}


def window_loss(sums: dict, pairs: int, chosen_targets: int) -> torch.Tensor:
    """The loss to backward for one micro batch: its sums over the WINDOW's pairs (and chosen target tokens, for the
    sft term), counted over every micro batch and process of the window; the window's gradient is then the mean
    over its pairs, as one batch of all of them would give."""
    loss = sums["pair_loss"] / max(pairs, 1)
    if chosen_targets:
        loss = loss + sums["sft"] / chosen_targets
    return loss
