"""Data for the loop: load a dataset, detect its format, tokenize with label masking, batch.

Three formats, detected from the columns or set with `dataset_format`:
- `text`: a `text` column; every token is a target.
- `prompt_completion`: `prompt` + `completion`; only completion tokens are targets.
- `messages`: chat turns rendered with the tokenizer's chat template; only assistant tokens are targets.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import RecipeError, did_you_mean
from ..planning.paths import FILE_BUILDERS
from ..planning.recipe import FORMAT_COLUMNS
from ..planning.registry import EMBEDDED_DATASET
from ..planning.rules import template_fields

if TYPE_CHECKING:
    from datasets import Dataset  # (imported where it loads: datasets is slow to import)
    from torch.utils.data import Dataset as TorchDataset

IGNORE = -100  # label of tokens that are not targets (prompt, user turns, padding)
NO_TEMPLATE = ("the dataset has 'messages' but the tokenizer has no chat template: set chat_template to a Jinja "
               "file (chat_template: template.jinja), or use prompt/completion data")


def load_any(source: str | None, split: str = "train"):
    """A `datasets.Dataset` from a local file or folder, or a hub dataset id; None: the embedded one."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its builders log what we raise again in one line
    path = Path(source) if source else EMBEDDED_DATASET
    try:
        if path.suffix in FILE_BUILDERS:
            if not path.is_file():
                raise RecipeError(f"dataset file {path} does not exist")
            return datasets.load_dataset(FILE_BUILDERS[path.suffix], data_files=str(path), split="train")
        if path.is_dir():
            if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
                return datasets.load_from_disk(str(path))
            return datasets.load_dataset(str(path), split=split)
        if source.startswith((".", "/", "~")):
            raise RecipeError(f"dataset {source} does not exist")
        return datasets.load_dataset(str(source), split=split)
    except RecipeError:
        raise
    except Exception as e:  # the hub and the builders raise many kinds; the user needs one line
        if path.suffix in (".jsonl", ".json") and path.is_file():
            _check_json_lines(path)  # names the empty file, or the bad line, when that is the cause
        text = " ".join(str(e).split())
        if "offline" in text.lower() or "connect" in text.lower() or "couldn't find" in text.lower():
            raise RecipeError(f"dataset {source!r} is neither a local file/folder nor reachable on the hub "
                              f"(offline?): give a .jsonl/.json/.parquet/.csv file or a folder") from None
        raise RecipeError(f"cannot load dataset {source!r}: {text[:300]}") from None


def _check_json_lines(path: Path) -> None:
    """A one-line error for an empty JSON(L) file, or the first line that is not a JSON object."""
    import json

    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise RecipeError(f"dataset file {path} is empty: give one JSON object per line")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return  # a JSON array: the builder's own message stands
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecipeError(f"dataset file {path}, line {number}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise RecipeError(f"dataset file {path}, line {number}: a JSON object ({{...}}) per line, got "
                              f"{type(row).__name__}")


# Message roles as the chat formats people have name them -> the chat template's. ShareGPT (axolotl's and
# LLaMA-Factory's `sharegpt` type) writes {from, value} turns as human / gpt / system; others name the assistant
# model, chatgpt, bing or bard, and tool results function, observation or ipython.
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "model": "assistant",
         "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system", "tool": "tool",
         "function": "tool", "observation": "tool", "ipython": "tool"}


def conversation(messages, where: str = "") -> list[dict]:
    """A conversation as the chat template takes it: {role, content} turns, ShareGPT's {from, value} turns and the
    role names in ROLES mapped; anything else is one line naming what the turns need."""
    if not isinstance(messages, (list, tuple)):
        raise RecipeError(f"{where}a conversation is a list of {{role, content}} messages, got {_kind(messages)}")
    out = []
    for n, message in enumerate(messages, 1):
        # (datasets reads a file's turns as one struct: keys a row lacks are None)
        sharegpt = isinstance(message, dict) and message.get("role") is None and message.get("from") is not None
        keys = ("from", "value") if sharegpt else ("role", "content")
        if not isinstance(message, dict) or any(message.get(k) is None for k in keys):
            raise RecipeError(f"{where}message {n} is {_kind(message)}: each message needs role and content (or "
                              "ShareGPT's from and value)")
        role, content = message[keys[0]], message[keys[1]]
        if role not in ROLES:
            raise RecipeError(f"{where}message {n} has role {role!r}{did_you_mean(str(role), list(ROLES))}; known: "
                              f"{', '.join(ROLES)}")
        if not isinstance(content, str):
            raise RecipeError(f"{where}message {n}'s content is {_kind(content)}, not text")
        out.append({"role": ROLES[role], "content": content})
    return out


def _kind(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def detect_format(columns, declared: str = "auto") -> str:
    """The dataset's format from its columns; a one-line error naming the columns it has."""
    columns = list(columns)
    if declared != "auto":
        missing = [c for c in FORMAT_COLUMNS[declared] if c not in columns]
        if missing:
            raise RecipeError(f"dataset_format {declared} needs column(s) {', '.join(missing)}; "
                              f"the dataset has: {', '.join(columns)} (map yours with a dataset entry's columns:)")
        return declared
    for fmt, needed in FORMAT_COLUMNS.items():
        if all(c in columns for c in needed):
            return fmt
    raise RecipeError(f"the dataset needs a 'messages', 'prompt'+'completion' or 'text' column; it has: "
                      f"{', '.join(columns)} (map yours with a dataset entry's columns:, e.g. completion: output)")


def sources(spec, dataset_format: str = "auto") -> list:
    """The recipe's `dataset` (or `eval_dataset`) as a list of DataSource: one string (None: the embedded
    dataset) is one source of the recipe's dataset_format; an entry's format `auto` defers to it too."""
    from dataclasses import replace

    from ..planning.recipe import DataSource

    if spec is None or isinstance(spec, str):
        return [DataSource(path=spec, format=dataset_format)]  # pyright: ignore[reportArgumentType]  (None: the embedded)
    return [replace(s, format=dataset_format) if s.format == "auto" else s for s in spec]


def _check_columns(mapping: dict, columns: list[str], where: str) -> None:
    for key, spec in mapping.items():
        if "{" in spec:
            if key == "messages":
                raise RecipeError(f"{where}columns.messages must name a column of conversations, not a template")
            names = template_fields(spec)
            missing = [n for n in names if n not in columns]
            if missing or not names:
                raise RecipeError(f"{where}columns.{key}: the template {spec!r} names "
                                  + (f"column {missing[0]!r}, which the dataset has not" if missing else "no column")
                                  + f"; it has: {', '.join(columns)}")
        elif spec not in columns:
            raise RecipeError(f"{where}columns.{key}: no column {spec!r}{did_you_mean(spec, columns)}; "
                              f"the dataset has: {', '.join(columns)}")


def _map_columns(row: dict, mapping: dict) -> dict:
    values = {k: "" if v is None else v for k, v in row.items()}
    return {key: spec.format_map(values) if "{" in spec else row[spec] for key, spec in mapping.items()}


def map_columns(raw, columns, where: str = "") -> Dataset:
    """A source's rows with its `columns:` applied (each field from a column of another name, or a template over
    the row's columns); unchanged where none is set."""
    from dataclasses import asdict

    fields = asdict(columns)
    mapping = {k: v for k, v in fields.items() if v}
    if not mapping:
        return raw
    _check_columns(mapping, raw.column_names, where)
    # a field left unset is the column of its own name (`columns: {completion: output}` keeps `prompt`)
    kept = [c for c in raw.column_names if c in fields and c not in mapping]
    return raw.map(_map_columns, fn_kwargs={"mapping": mapping},
                   remove_columns=[c for c in raw.column_names if c not in kept],
                   new_fingerprint=fingerprint(raw, {"mapping": mapping}, _map_columns))


def load_source(source, seed: int = 0, where: str = ""):
    """(rows in the three formats' columns, format, rows in the source): a source loaded, its columns
    mapped, and its `fraction` of rows drawn with the seed."""
    paired = [key for key in ("chosen", "rejected") if getattr(source.columns, key)]
    if paired:
        raise RecipeError(f"{where}columns.{paired[0]} maps preference pairs, which run dpo trains: remove it here")
    raw = map_columns(load_any(source.path, source.split), source.columns, where)
    if "conversations" in raw.column_names and "messages" not in raw.column_names and source.format in ("auto",
                                                                                                        "messages"):
        raw = raw.rename_column("conversations", "messages")  # ShareGPT's column: its turns are mapped in tokenize
    fmt = detect_format(raw.column_names, source.format)
    total = len(raw)
    if source.fraction < 1:
        taken = int(source.fraction * total)
        if taken == 0:
            raise RecipeError(f"{where}fraction {source.fraction} of {total} rows takes none: raise it")
        raw = raw.shuffle(seed=seed).select(range(taken))
    return raw, fmt, total


def tokenize(example: dict, tokenizer, fmt: str, max_seq_length: int, train_on_inputs: bool = False) -> dict:
    """input_ids and labels (IGNORE where the token is not a target), truncated to max_seq_length.
    train_on_inputs: the prompt / user turns are targets too."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if fmt == "text":
        ids = tokenizer(example["text"])["input_ids"] + eos
        labels = list(ids)
    elif fmt == "prompt_completion":
        prompt = tokenizer(example["prompt"])["input_ids"]
        completion = tokenizer(example["completion"], add_special_tokens=False)["input_ids"] + eos
        ids, labels = prompt + completion, [IGNORE] * len(prompt) + completion
    else:
        ids, labels = _tokenize_chat(conversation(example["messages"]), tokenizer)
    if train_on_inputs:
        labels = list(ids)
    return {"input_ids": ids[:max_seq_length], "labels": labels[:max_seq_length], "cut": max(0, len(ids) - max_seq_length)}


def _tokenize_chat(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """Render the conversation; mark as targets the characters each assistant turn adds.

    Works with any chat template that renders a conversation as the prefix of its continuation:
    turn i's text spans from the render of messages[:i] (with the generation prompt) to the
    render of messages[:i+1]; tokens are mapped to characters with the fast tokenizer's offsets.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeError(NO_TEMPLATE)

    def render(msgs, gen=False):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = render(messages[:i], gen=True), render(messages[: i + 1])
        if not (full.startswith(start) and full.startswith(end)):
            raise RecipeError("this tokenizer's chat template does not render conversations prefix by prefix, "
                              "so assistant tokens cannot be found: use prompt/completion data")
        spans.append((len(start), len(end)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    labels = [tok if any(s <= a < e for s, e in spans) else IGNORE for tok, (a, _) in zip(ids, enc["offset_mapping"])]
    return ids, labels


def bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing bin packing: indices of the documents grouped into rows of at most `capacity`
    tokens, each document whole. Longest first, each into the fullest row it still fits (a sorted list
    of the free space left in open rows), so rows end up nearly full."""
    import bisect

    rows: list[list[int]] = []
    free: list[int] = []  # sorted free space of the open rows
    open_rows: dict[int, list[int]] = {}  # free space -> rows with that much left
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        at = bisect.bisect_left(free, n)
        if at < len(free):  # the row with the least room that still holds it
            space = free.pop(at)
            row = open_rows[space].pop()
            if open_rows[space]:
                bisect.insort(free, space)
        else:
            space, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        left = space - n
        if left > 0:
            if not open_rows.setdefault(left, []):
                bisect.insort(free, left)
            open_rows[left].append(row)
    return rows


def pack(ds, max_seq_length: int):
    """Whole documents packed into rows of at most max_seq_length tokens (bins): each document keeps its
    own positions (position_ids restart at 0), and its first token is no target (in a row of its own it
    has nothing before it to be predicted from; packed, the token before it is another document's end).
    The loss and the model see document boundaries through position_ids (loss.model_inputs)."""
    from datasets import Dataset

    ids, labels = ds["input_ids"], ds["labels"]
    rows = {"input_ids": [], "labels": [], "position_ids": []}
    for row in bins([len(x) for x in ids], max_seq_length):
        rows["input_ids"].append([t for i in row for t in ids[i]])
        rows["labels"].append([t for i in row for t in [IGNORE, *labels[i][1:]]])
        rows["position_ids"].append([p for i in row for p in range(len(ids[i]))])
    return Dataset.from_dict(rows)


def learnable(labels: list[int]) -> bool:
    """Whether a tokenized example has a target to learn from (a document's first token never is one)."""
    return any(label != IGNORE for label in labels[1:])


def check_targets(raw, fmt: str, tokenizer, recipe, where: str = "", sample: int = 256) -> None:
    """Refuse, before launch, a source none of whose first `sample` examples keeps a target token within
    max_seq_length (every prompt longer than it, say): the loop would drop them all."""
    from transformers.utils import logging as hf_logging

    rows = raw.select(range(min(sample, len(raw))))
    if len(rows) == 0:
        raise RecipeError(f"{where}the dataset has no rows")
    lengths, verbosity = [], hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notice that a text is longer than the model's maximum: the point here
    try:
        for n, row in enumerate(rows, 1):
            try:
                example = tokenize(row, tokenizer, fmt, recipe.max_seq_length, recipe.train_on_inputs)
            except RecipeError as e:
                raise RecipeError(f"{where}row {n}: {e}") from None
            if learnable(example["labels"]):
                return
            lengths.append(len(example["input_ids"]) + example["cut"])
    finally:
        hf_logging.set_verbosity(verbosity)
    which = f"its {len(rows)} examples" if len(rows) == len(raw) else f"its first {len(rows)} examples"
    raise RecipeError(f"{where}none of {which} has a target token within max_seq_length={recipe.max_seq_length} "
                      f"(they are {min(lengths)}{'' if min(lengths) == max(lengths) else f' to {max(lengths)}'} tokens "
                      "long, the prompt first): raise max_seq_length, or shorten the prompts")


def fingerprint(ds, options: dict, *functions) -> str:
    """A mapped dataset's cache key. datasets hashes a module's function by its name only, so a changed
    tokenize() would read the cache its old code wrote: the code is part of the key here."""
    import inspect

    from datasets.fingerprint import Hasher

    code = [inspect.getsource(f) for f in functions or (tokenize, _tokenize_chat, conversation)]
    return Hasher.hash([ds._fingerprint, code, options])


def load_sources(spec, recipe, name: str):
    """Each source of `dataset` (name "train") or `eval_dataset` ("eval"), loaded: yields (source, rows,
    format, rows in the source); with several, an error names the entry: `train dataset[1] (path): ...`."""
    for i, source in enumerate(sources(spec, recipe.dataset_format)):
        where = f"{name} dataset[{i}] ({source.path}): " if isinstance(spec, tuple) else ""
        yield (source, *load_source(source, recipe.seed, where))


def mixture(spec, recipe, tokenizer, say, name: str):
    """The tokenized rows of `dataset` (or `eval_dataset`): each source loaded, its fraction drawn,
    tokenized in its own format; several are shuffled together with the seed, and `say` gets a line
    per source (rows taken, tokens, share of the mix). Returns (dataset, formats)."""
    from datasets import concatenate_datasets

    parts, formats, lines = [], [], []
    for source, raw, fmt, total in load_sources(spec, recipe, name):
        options = {"tokenizer": tokenizer, "fmt": fmt, "max_seq_length": recipe.max_seq_length,
                   "train_on_inputs": recipe.train_on_inputs}
        part = raw.map(tokenize, fn_kwargs=options, remove_columns=list(raw.column_names),
                       new_fingerprint=fingerprint(raw, options))
        parts.append(part)
        formats.append(fmt)
        lines.append((source, fmt, len(part), total, sum(len(ids) for ids in part["input_ids"])))
    if len(parts) == 1:
        return parts[0], formats
    mixed = concatenate_datasets(parts).shuffle(seed=recipe.seed)
    tokens = sum(line[-1] for line in lines)
    for source, fmt, rows, total, n in lines:
        say(f"data: {name} source {source.path}{f' [{source.split}]' if source.split != 'train' else ''}: {fmt}, "
            f"{rows:,} of {total:,} rows (fraction {source.fraction:g}), {n:,} tokens, {n / max(tokens, 1):.0%} of the mix")
    return mixed, formats


def held_out(train, recipe):
    """(train, eval): `eval_size` of the examples held out (datasets' train_test_split, seeded). A dataset of one
    example has none to spare: one line (the split's own error is a traceback)."""
    if len(train) < 2:
        raise RecipeError(f"the dataset has {len(train)} example(s): too few to hold out eval_size={recipe.eval_size:g} "
                          "of them for an eval loss; add examples, or set eval_size=0")
    split = train.train_test_split(test_size=recipe.eval_size, seed=recipe.seed)
    return split["train"], split["test"]


def prepare_datasets(recipe, tokenizer, say=None) -> tuple[TorchDataset, TorchDataset | None]:
    """(train, eval or None): tokenized datasets of input_ids/labels, as the recipe asks. `say` gets one
    line per split: the format, examples kept and dropped (and why), the share of tokens that are targets
    (and one per source of a mixture)."""
    say = say or (lambda *a, **k: None)
    train, formats = mixture(recipe.dataset, recipe, tokenizer, say, "train")
    eval_set = None
    if recipe.eval_dataset:
        eval_set, eval_formats = mixture(recipe.eval_dataset, recipe, tokenizer, say, "eval")
    elif recipe.eval_size:
        (train, eval_set), eval_formats = held_out(train, recipe), formats

    def finish(ds, name, fmts):
        rows = len(ds)
        ds = ds.filter(lambda ex: learnable(ex["labels"]))  # nothing to learn: drop
        if len(ds) == 0:  # (memrecipe run's preflight says so before launch; a plain launch learns it here)
            raise RecipeError(f"no {name} example has a target token within max_seq_length={recipe.max_seq_length} "
                              f"(all {rows} dropped): raise max_seq_length, or shorten the prompts")
        cut = [n for n in ds["cut"] if n]
        ds = ds.remove_columns("cut")
        packed = pack(ds, recipe.max_seq_length) if recipe.packing else None
        tokens = sum(len(ids) for ids in ds["input_ids"])
        targets = sum(sum(label != IGNORE for label in labels[1:]) for labels in ds["labels"])
        dropped = f", {rows - len(ds)} dropped (no target token within max_seq_length)" if rows > len(ds) else ""
        truncated = (f", {len(cut)} truncated to max_seq_length={recipe.max_seq_length} ({sum(cut):,} tokens "
                     "cut)" if cut else "")
        shape = (f"; packed into {len(packed):,} rows of <= {recipe.max_seq_length} tokens, "
                 f"{tokens / (len(packed) * recipe.max_seq_length):.0%} full" if packed is not None else "")
        say(f"data: {name}: {' + '.join(dict.fromkeys(fmts))} format, {len(ds):,} examples kept{dropped}{truncated}, "
            f"{tokens:,} tokens of which {targets / max(tokens, 1):.0%} are targets"
            + (" (train_on_inputs)" if recipe.train_on_inputs else "") + shape)
        return packed if packed is not None else ds

    # (datasets.Dataset is map-style, what a DataLoader reads, though not a torch Dataset subclass)
    return finish(train, "train", formats), finish(eval_set, "eval", eval_formats) if eval_set is not None else None  # pyright: ignore[reportReturnType]


class Collator:
    """Pad a list of examples to the longest in the batch (right padding), or up to a multiple of
    `multiple` tokens (a compiled model then sees few shapes). `attention_mask` marks the real tokens;
    packed rows also carry `position_ids`, their padding numbered as a document of its own. Under Ulysses
    (`sequence_parallel` > 1) every row carries position_ids (the attention runs causal by position, without a
    mask) and rows are padded to a multiple of the group's size, which cuts them into equal slices."""

    def __init__(self, pad_token_id: int, multiple: int = 1, sequence_parallel: int = 1):
        self.pad, self.multiple = pad_token_id, math.lcm(multiple, sequence_parallel)
        self.positions = sequence_parallel > 1

    def __call__(self, examples: list[dict]) -> dict:
        import torch

        width = -(-max(len(ex["input_ids"]) for ex in examples) // self.multiple) * self.multiple
        out = {"input_ids": [], "labels": [], "attention_mask": []}
        packed = "position_ids" in examples[0]
        if packed or self.positions:
            out["position_ids"] = []
        for ex in examples:
            gap = width - len(ex["input_ids"])
            out["input_ids"].append(ex["input_ids"] + [self.pad] * gap)
            out["labels"].append(ex["labels"] + [IGNORE] * gap)
            out["attention_mask"].append([1] * len(ex["input_ids"]) + [0] * gap)
            if packed:
                out["position_ids"].append(ex["position_ids"] + list(range(gap)))
            elif self.positions:  # one example: its positions run on through the padding, which no target reads
                out["position_ids"].append(list(range(width)))
        return {key: torch.tensor(value) for key, value in out.items()}
