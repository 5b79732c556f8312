"""Data: formats from columns, label masking, truncation, packing, loading local files."""

import json
import re

import pytest

from memrecipe.errors import RecipeError
from memrecipe.planning.registry import EMBEDDED_MODEL, load_recipe
from memrecipe.training.data import IGNORE, Collator, detect_format, load_any, pack, prepare_datasets, tokenize
from memrecipe.training.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(EMBEDDED_MODEL))


def targets(ex, tok):
    return tok.decode([t for t, label in zip(ex["input_ids"], ex["labels"]) if label != IGNORE])


def test_formats_are_detected_from_columns():
    assert detect_format(["messages"]) == "messages"
    assert detect_format(["prompt", "completion", "id"]) == "prompt_completion"
    assert detect_format(["text"]) == "text"
    with pytest.raises(RecipeError, match="it has: question, answer"):
        detect_format(["question", "answer"])
    with pytest.raises(RecipeError, match="needs column.*completion.*has: prompt"):
        detect_format(["prompt"], "prompt_completion")


def test_prompt_completion_learns_only_the_completion(tok):
    ex = tokenize({"prompt": "What is 2 plus 2?", "completion": " 2 plus 2 is 4."}, tok, "prompt_completion", 512)
    assert len(ex["input_ids"]) == len(ex["labels"])
    assert targets(ex, tok) == " 2 plus 2 is 4.<|im_end|>"
    assert ex["labels"][0] == IGNORE


def test_chat_learns_only_assistant_turns(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What color is snow?"},
                {"role": "assistant", "content": "Snow is white."}, {"role": "user", "content": "And coal?"},
                {"role": "assistant", "content": "Coal is black."}]
    ex = tokenize({"messages": messages}, tok, "messages", 512)
    learned = targets(ex, tok)
    assert "Snow is white." in learned and "Coal is black." in learned
    assert "snow?" not in learned and "Be brief" not in learned and "coal?" not in learned
    assert tok.decode(ex["input_ids"]) == tok.apply_chat_template(messages, tokenize=False)


def test_text_learns_every_token_and_truncates(tok):
    ex = tokenize({"text": "apple river stone " * 50}, tok, "text", 16)
    assert len(ex["input_ids"]) == 16 and ex["labels"] == ex["input_ids"] and ex["cut"] > 0  # counted for the log


def test_packing_keeps_documents_whole_and_drops_nothing():
    from datasets import Dataset

    rows = {"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]], "labels": [[IGNORE, 2, 3], [4, 5], [6, IGNORE, 8, 9]]}
    packed = pack(Dataset.from_dict(rows), 5)
    assert packed["input_ids"] == [[6, 7, 8, 9], [1, 2, 3, 4, 5]]  # longest first, each into the fullest row it fits
    assert packed["labels"] == [[IGNORE, IGNORE, 8, 9], [IGNORE, 2, 3, IGNORE, 5]]  # a document's first token: no target
    assert packed["position_ids"] == [[0, 1, 2, 3], [0, 1, 2, 0, 1]]


def test_collator_numbers_a_packed_rows_padding_as_a_document_of_its_own():
    batch = Collator(pad_token_id=0)([{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7], "position_ids": [0, 0, 1]},
                                      {"input_ids": [8, 9], "labels": [IGNORE, 9], "position_ids": [0, 1]}])
    assert batch["position_ids"].tolist() == [[0, 0, 1], [0, 1, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]  # what the report counts as real tokens


def test_collator_pads_right_and_masks_padding():
    batch = Collator(pad_token_id=0)([{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]},
                                      {"input_ids": [8], "labels": [8]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


@pytest.mark.parametrize("suffix", ["jsonl", "json", "parquet", "csv"])
def test_local_files_load_in_every_format(tmp_path, suffix):
    import datasets

    rows = [{"prompt": f"What is {i} plus 1?", "completion": f" {i + 1}."} for i in range(6)]
    path = tmp_path / f"data.{suffix}"
    ds = datasets.Dataset.from_list(rows)
    {"jsonl": lambda: ds.to_json(path), "json": lambda: path.write_text(json.dumps(rows)),
     "parquet": lambda: ds.to_parquet(path), "csv": lambda: ds.to_csv(path, index=False)}[suffix]()
    loaded = load_any(str(path))
    assert loaded.num_rows == 6 and detect_format(loaded.column_names) == "prompt_completion"


def test_missing_file_and_unreachable_hub_id_are_one_line():
    with pytest.raises(RecipeError, match="does not exist"):
        load_any("/nowhere/data.jsonl")
    with pytest.raises(RecipeError, match="neither a local file/folder nor reachable"):
        load_any("someone/no-such-dataset-here")


def test_embedded_dataset_splits_and_has_targets(tok):
    recipe = load_recipe("single-gpu-lora", ["packing=false"])
    train, evals = prepare_datasets(recipe, tok)
    assert train.num_rows > 250 and 20 < evals.num_rows < 50
    for ex in train.select(range(20)):
        assert any(label != IGNORE for label in ex["labels"][1:])
        assert len(ex["input_ids"]) <= recipe.max_seq_length
    said = []
    packed, _ = prepare_datasets(load_recipe("single-gpu-lora", ["packing=true", "max_seq_length=32"]), tok, said.append)
    assert max(len(x) for x in packed["input_ids"]) <= 32 and packed.num_rows < train.num_rows
    unpacked, _ = prepare_datasets(load_recipe("single-gpu-lora", ["packing=false", "max_seq_length=32"]), tok)
    tokens = sorted(t for ids in unpacked["input_ids"] for t in ids)
    assert sorted(t for ids in packed["input_ids"] for t in ids) == tokens  # every token of every example
    assert "truncated to max_seq_length=32" in said[0] and "packed into" in said[0] and "% full" in said[0]


def test_a_given_eval_dataset_wins_over_eval_size_and_null_means_no_eval(tok, tmp_path):
    import json

    from memrecipe.planning.registry import EMBEDDED_DATASET

    rows = EMBEDDED_DATASET.read_text().splitlines()
    (tmp_path / "eval.jsonl").write_text("\n".join(rows[:5]) + "\n")
    r = load_recipe("single-gpu-lora", [f"eval_dataset={tmp_path / 'eval.jsonl'}", "packing=false"])  # eval_size 0.1
    assert r.eval_size == 0.1
    train, evals = prepare_datasets(r, tok)
    assert len(evals) == 5 and len(train) == sum(1 for line in rows if json.loads(line))  # nothing held out
    _, none = prepare_datasets(load_recipe("single-gpu-lora", ["eval_size=null"]), tok)
    assert none is None


def test_a_dataset_of_one_example_cannot_spare_an_eval_split_and_says_so_in_one_line(tok, tmp_path):
    """eval_size over one example left datasets' train_test_split to raise a traceback (a user's first try with a
    one-line file); SFT and preference data say it in one line, and two examples split one and one."""
    from memrecipe.training.preference import prepare_pairs

    (tmp_path / "one.jsonl").write_text('{"prompt": "hi", "completion": "there"}\n')
    (tmp_path / "pair.jsonl").write_text('{"prompt": "hi", "chosen": "yes", "rejected": "no"}\n')
    for prepare, name, script in [(prepare_datasets, "one", "sft"), (prepare_pairs, "pair", "dpo")]:
        with pytest.raises(RecipeError, match=r"has 1 example\(s\): too few to hold out eval_size=0.1 .* eval_size=0"):
            prepare(load_recipe("single-gpu-lora", [f"dataset={tmp_path / name}.jsonl"], script), tok)
    (tmp_path / "two.jsonl").write_text('{"prompt": "hi", "completion": "there"}\n{"prompt": "a", "completion": "b"}\n')
    train, evals = prepare_datasets(load_recipe("single-gpu-lora", [f"dataset={tmp_path / 'two.jsonl'}",
                                                                     "packing=false"]), tok)
    assert (len(train), len(evals)) == (1, 1)
    train, evals = prepare_datasets(load_recipe("single-gpu-lora", [f"dataset={tmp_path / 'one.jsonl'}",
                                                                     "eval_size=0"]), tok)
    assert evals is None and len(train) == 1


def test_an_empty_or_malformed_jsonl_is_named_with_its_reason_and_line(tmp_path, capfd):
    from memrecipe.errors import RecipeError

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n\n{"text": "b"\n')
    with pytest.raises(RecipeError, match="empty.jsonl is empty"):
        load_any(str(tmp_path / "empty.jsonl"))
    with pytest.raises(RecipeError, match=r"bad.jsonl, line 3: not valid JSON"):
        load_any(str(tmp_path / "bad.jsonl"))
    assert "Failed to load JSON" not in capfd.readouterr().err  # one line: the builder's log stays quiet


def mixture_files(folder):
    """20 alpaca-style rows (instruction/input/output) in a JSONL, 10 chat conversations in a parquet."""
    from datasets import Dataset

    from memrecipe.planning.registry import EMBEDDED_DATASET

    alpaca = folder / "alpaca.jsonl"
    alpaca.write_text("".join(json.dumps({"instruction": f"Add {i} and {i + 1}.", "input": "" if i % 2 else "Be brief.",
                                          "output": f" It is {2 * i + 1}."}) + "\n" for i in range(20)))
    chats = [json.loads(line) for line in EMBEDDED_DATASET.read_text().splitlines()[:10]]
    Dataset.from_list(chats).to_parquet(str(folder / "chat.parquet"))
    return alpaca, folder / "chat.parquet"


def mixture_recipe(folder, *overrides):
    alpaca, chat = mixture_files(folder)
    entries = [{"path": str(alpaca), "fraction": 0.7,
                "columns": {"prompt": "{instruction}\n{input}", "completion": "output"}},
               {"path": str(chat), "fraction": 0.3}]
    return load_recipe("single-gpu-lora", [f"dataset={json.dumps(entries)}", "eval_size=0", "packing=false", *overrides])


def test_a_mixture_maps_columns_draws_fractions_with_the_seed_and_says_what_it_took(tok, tmp_path):
    said = []
    train, _ = prepare_datasets(mixture_recipe(tmp_path), tok, said.append)
    assert len(train) == 14 + 3  # int(0.7 x 20) alpaca rows, int(0.3 x 10) conversations
    sources = [line for line in said if "source" in line]
    assert "prompt_completion, 14 of 20 rows (fraction 0.7)" in sources[0]
    assert "messages, 3 of 10 rows (fraction 0.3)" in sources[1]
    tokens = [int(line.split(" rows (fraction")[1].split("), ")[1].split(" tokens")[0].replace(",", "")) for line in sources]
    assert sum(tokens) == sum(len(x) for x in train["input_ids"])
    assert "prompt_completion + messages format" in said[-1]
    texts = [tok.decode(ids) for ids in train["input_ids"]]
    alpaca = [t for t in texts if t.startswith("Add ")]
    assert len(alpaca) == 14 and any("\nBe brief. It is" in t for t in alpaca)  # the template, then the output
    assert all(targets(ex, tok).startswith(" It is") for ex in train if tok.decode(ex["input_ids"]).startswith("Add "))
    again, _ = prepare_datasets(mixture_recipe(tmp_path), tok)
    assert again["input_ids"] == train["input_ids"]  # the same seed: the same rows, in the same order
    other, _ = prepare_datasets(mixture_recipe(tmp_path, "seed=3"), tok)
    assert sorted(map(tuple, other["input_ids"])) != sorted(map(tuple, train["input_ids"]))


@pytest.mark.parametrize("columns, reason", [
    ({"prompt": "{instruction}\n{inputs}", "completion": "output"},
     "dataset[0] (DATA): columns.prompt: the template '{instruction}\\n{inputs}' names column 'inputs'"),
    ({"prompt": "instruction", "completion": "outptu"}, "columns.completion: no column 'outptu' (did you mean 'output'?)"),
    ({"messages": "{instruction}"}, "columns.messages must name a column of conversations, not a template"),
    ({"prompt": "instruction"}, "needs a 'messages', 'prompt'+'completion' or 'text' column"),
    ({"chosen": "output"}, "columns.chosen maps preference pairs, which run dpo trains: remove it here"),
])
def test_a_bad_column_mapping_is_one_line_naming_the_column(tok, tmp_path, columns, reason):
    alpaca, _ = mixture_files(tmp_path)
    entries = json.dumps([{"path": str(alpaca), "columns": columns}])
    with pytest.raises(RecipeError, match=re.escape(reason.replace("DATA", str(alpaca)))):
        prepare_datasets(load_recipe("single-gpu-lora", [f"dataset={entries}"]), tok)


def test_a_partial_column_mapping_keeps_the_fields_it_does_not_name(tok, tmp_path):
    """`columns: {completion: output}` on prompt/output data: `prompt` is still the column of that name."""
    data = tmp_path / "po.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Add {i} and {i + 1}.", "output": f" It is {2 * i + 1}.",
                                        "text": "not this"}) + "\n" for i in range(6)))
    entries = json.dumps([{"path": str(data), "columns": {"completion": "output"}}])
    said = []
    train, _ = prepare_datasets(load_recipe("single-gpu-lora", [f"dataset={entries}", "eval_size=0", "packing=false"]),
                                tok, said.append)
    assert "prompt_completion format, 6 examples kept" in said[-1]
    assert all(targets(ex, tok).startswith(" It is") for ex in train)  # the mapped column is the completion
    assert all(tok.decode(ex["input_ids"]).startswith("Add ") for ex in train)


@pytest.mark.parametrize("packing", [False, True])
def test_train_on_inputs_makes_every_token_after_a_documents_first_a_target(tok, packing):
    import torch
    from transformers import AutoModelForCausalLM

    from memrecipe.training.loading import embedded_model
    from memrecipe.training.loss import count_targets, lm_loss

    r = load_recipe("single-gpu-lora", ["train_on_inputs=true", f"packing={str(packing).lower()}", "eval_size=0",
                                        "max_seq_length=64"])
    train, _ = prepare_datasets(r, tok)
    rows = train.select(range(4))
    batch = Collator(tok.pad_token_id)(list(rows))
    real = int(batch["attention_mask"].sum())
    documents = sum(p.count(0) for p in rows["position_ids"]) if packing else len(rows)
    assert count_targets(batch) == real - documents  # every real token but each document's first
    shifted = batch["labels"][:, 1:]
    assert torch.equal(shifted[shifted != IGNORE], batch["input_ids"][:, 1:][shifted != IGNORE])
    masked, _ = prepare_datasets(load_recipe("single-gpu-lora", [f"packing={str(packing).lower()}", "eval_size=0",
                                                                 "max_seq_length=64"]), tok)
    assert count_targets(Collator(tok.pad_token_id)(list(masked.select(range(4))))) < real - documents
    # the loss covers them: the sum of every target's cross-entropy, computed here from the plain logits
    model = AutoModelForCausalLM.from_pretrained(embedded_model(), dtype=torch.float32)
    with torch.no_grad():
        inputs = {"input_ids": batch["input_ids"], **({"position_ids": batch["position_ids"]} if packing
                                                     else {"attention_mask": batch["attention_mask"]})}
        logits = model(**inputs).logits[:, :-1]
        manual = torch.nn.functional.cross_entropy(logits[shifted != IGNORE], batch["input_ids"][:, 1:][shifted != IGNORE],
                                                   reduction="sum")
        assert lm_loss(model, batch).item() == pytest.approx(manual.item(), rel=1e-5)


SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def sharegpt(path, rows):
    """The embedded chat set's first rows as ShareGPT writes them: `conversations` of {from, value} turns."""
    lines = [{"conversations": [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in row["messages"]]}
             for row in rows]
    path.write_text("\n".join(json.dumps(line) for line in lines))
    return path


def test_sharegpt_trains_as_the_messages_it_holds_with_or_without_a_mapping(tok, tmp_path):
    """ShareGPT (axolotl's and LLaMA-Factory's `sharegpt` type) needs no mapping: `conversations` of human / gpt /
    system turns tokenize to the same ids and targets as the same messages under their own names; so does
    `columns: {messages: conversations}`."""
    from memrecipe.planning.registry import EMBEDDED_DATASET

    rows = [json.loads(line) for line in EMBEDDED_DATASET.read_text().splitlines()[:24]]
    (tmp_path / "messages.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    path = sharegpt(tmp_path / "sharegpt.jsonl", rows)
    (tmp_path / "mapped.yaml").write_text(f"base: single-gpu-lora\ndataset: [{{path: {path}, columns: {{messages: "
                                          "conversations}}]\n")
    common = ["eval_size=0", "packing=false"]
    reference, _ = prepare_datasets(load_recipe("single-gpu-lora", [*common, f"dataset={tmp_path}/messages.jsonl"]),
                                    tok)
    for recipe in (load_recipe("single-gpu-lora", [*common, f"dataset={path}"]),
                   load_recipe(str(tmp_path / "mapped.yaml"), common)):
        got, _ = prepare_datasets(recipe, tok)
        assert got["input_ids"] == reference["input_ids"] and got["labels"] == reference["labels"]


@pytest.mark.parametrize("turn, says", [
    ({"speaker": "human", "text": "Hi"}, "message 1 is dict {'speaker': 'human', 'text': 'Hi'}: each message needs "
                                         "role and content (or ShareGPT's from and value)"),
    ({"role": "robot", "content": "Hi"}, "message 1 has role 'robot'"),
    ("Hi", "message 1 is str 'Hi'")])
def test_a_conversation_that_is_not_messages_is_one_line_naming_the_row(tok, tmp_path, turn, says):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [turn]}))
    with pytest.raises(RecipeError, match=re.escape(f"row 1: {says}")):
        from memrecipe.training.data import check_targets

        recipe = load_recipe("single-gpu-lora", [f"dataset={tmp_path}/bad.jsonl"])
        check_targets(load_any(str(tmp_path / "bad.jsonl")), "messages", tok, recipe)


def test_a_dry_run_reads_the_data_as_the_run_does(tmp_path, capsys):
    """--dry-run runs the checks before launch (it once accepted data the run then failed on): one line, exit 2,
    nothing written; good data previews the launch."""
    from memrecipe.main import main

    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"speaker": "x", "text": "y"}]}) + "\n")
    for data, status in ((tmp_path / "bad.jsonl", 2), (sharegpt(tmp_path / "good.jsonl", [
            {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}] * 4), 0)):
        with pytest.raises(SystemExit) as done:
            main(["run", "sft", "--recipe", "single-gpu-lora", "--dataset", str(data), "--dry-run", "--output-dir",
                  str(tmp_path / "run")])
        said = capsys.readouterr().err
        assert done.value.code == status, said
        assert ("row 1: message 1 is dict" in said) == (status == 2) and not (tmp_path / "run").exists()
