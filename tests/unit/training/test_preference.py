"""Preference tuning's pieces against TRL's own trainer (trl 1.16, in-process, on the same tiny model and pairs):
the tokenized pairs, the reference log-probabilities, each loss and TRL's metrics; and what TRL does not do:
pairs packed as documents (= one pair per row), the fused head (= full logits), accumulation by pairs over
uneven micro batches (= one batch of all of them)."""

import copy

import pytest
import torch
import trl  # a test dependency (pyproject.toml [test]): TRL's trainer is the reference

from memrecipe.planning.recipe import Dpo
from memrecipe.training.loading import embedded_model
from memrecipe.training.preference import (FREE_LOSSES, PairCollator, learnable_pair, pack_pairs, preference_sums,
                                           sequence_logps, split_prompt, tokenize_pair, window_loss)

MAX_LENGTH = 64


def text_pairs(n=8):
    return [{"prompt": f"Question {i}: what is {i} plus {i}?", "chosen": f" It is {2 * i}.",
             "rejected": f" Maybe {i + 3}, or {'not' if i % 2 else 'so, I would say, more or less'}."} for i in range(n)]


def chat_pairs(n=6):
    return [{"prompt": [{"role": "user", "content": f"What is {i} plus 1?"}],
             "chosen": [{"role": "assistant", "content": f"{i} plus 1 is {i + 1}."}],
             "rejected": [{"role": "assistant", "content": f"{i} plus 1 is {i + 7}, I think."}]} for i in range(n)]


def implicit(pairs):
    """The same pairs without a prompt column: the prompt is in both (as in HH-RLHF)."""
    return [{"chosen": p["prompt"] + p["chosen"], "rejected": p["prompt"] + p["rejected"]} for p in pairs]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model())


@pytest.fixture(scope="module")
def base():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(embedded_model(), dtype=torch.float32)


def trl_trainer(model, tokenizer, rows, tmp_path, **config):
    """TRL's DPOTrainer over `rows`, the reference's log-probs precomputed by TRL itself from `model` as given."""
    from datasets import Dataset

    args = trl.DPOConfig(output_dir=str(tmp_path), precompute_ref_log_probs=True, report_to="none",
                         max_length=MAX_LENGTH, per_device_train_batch_size=len(rows), use_cpu=True, bf16=False,
                         **config)
    return trl.DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)


def ours(rows, tokenizer, width=128, packing=True):
    from datasets import Dataset

    tokenized = [tokenize_pair(r, tokenizer, MAX_LENGTH) for r in rows]
    packed = pack_pairs(Dataset.from_list(tokenized), width, packing)
    return tokenized, PairCollator(tokenizer.pad_token_id)(list(packed))


@pytest.mark.parametrize("rows", [text_pairs(), chat_pairs(), implicit(text_pairs()), implicit(chat_pairs())],
                         ids=["text", "messages", "implicit-text", "implicit-messages"])
def test_pairs_tokenize_as_trl_tokenizes_them(tokenizer, base, tmp_path, rows):
    trainer = trl_trainer(copy.deepcopy(base), tokenizer, rows, tmp_path)
    tokenized, _ = ours(rows, tokenizer)
    for mine, theirs in zip(tokenized, trainer.train_dataset, strict=True):
        assert (mine["prompt_ids"], mine["chosen_ids"], mine["rejected_ids"]) == \
            (theirs["prompt_ids"], theirs["chosen_ids"], theirs["rejected_ids"])
    assert all(len(t["prompt_ids"]) > 0 for t in tokenized)  # the prompt was found, and is no completion


def test_the_implicit_prompt_is_the_shared_start():
    split = split_prompt({"chosen": "The sky is blue.", "rejected": "The sky is green."})
    assert split == {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}


def test_truncation_keeps_the_start_and_a_cut_away_completion_drops_the_pair(tokenizer):
    long_prompt = {"prompt": "word " * 80, "chosen": " yes.", "rejected": " no."}
    assert not learnable_pair(tokenize_pair(long_prompt, tokenizer, MAX_LENGTH))
    pair = tokenize_pair({"prompt": "Hi.", "chosen": " a" * 100, "rejected": " b."}, tokenizer, MAX_LENGTH)
    assert len(pair["prompt_ids"]) + len(pair["chosen_ids"]) == MAX_LENGTH and pair["cut"] > 0
    assert learnable_pair(pair)


@pytest.fixture(scope="module")
def lora_base(base):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0))
    return model


def perturbed(model, seed=1):
    """The policy a few steps away from the reference: its trained weights moved (LoRA's B starts at 0)."""
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def reference_logps(model, batch):
    """The reference: a LoRA model with its adapters off, else the model as it is (here, before perturbation)."""
    import contextlib

    with torch.no_grad(), (model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()):
        return sequence_logps(model, batch)


LOSSES = [dict(loss_type="sigmoid", beta=0.1), dict(loss_type="ipo", beta=0.5), dict(loss_type="hinge", beta=0.2),
          dict(loss_type="robust", beta=0.1, label_smoothing=0.2),
          dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], beta=0.1)]


@pytest.mark.parametrize("kind", ["full", "lora"])
@pytest.mark.parametrize("config", LOSSES, ids=lambda c: "+".join(c["loss_type"]) if isinstance(c["loss_type"], list)
                         else c["loss_type"])
def test_each_loss_and_its_metrics_equal_trls(tokenizer, base, lora_base, tmp_path, kind, config):
    """TRL's compute_loss on its padded [chosen; rejected] batch with its own precomputed reference, against ours on
    packed rows through the fused head, to 1e-5 in fp32."""
    from memrecipe.training.loss import fuse_head

    rows = text_pairs()
    start = base if kind == "full" else lora_base
    policy = perturbed(start)
    # TRL's reference: the model it is given (a given adapter is copied as its "ref" adapter), then trained to the
    # policy's weights; ours: the model before, or under LoRA the policy with its adapters off (B = 0 before)
    trainer = trl_trainer(copy.deepcopy(start), tokenizer, rows, tmp_path, **config)
    theirs_params = dict(trainer.model.named_parameters())
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if p.requires_grad:
                theirs_params[name].copy_(p)
    trainer.model.train()
    theirs = trainer.compute_loss(trainer.model, trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))]))
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    _, batch = ours(rows, tokenizer)
    assert batch["input_ids"].shape[0] < len(rows)  # several pairs share a row
    reference = reference_logps(start if kind == "full" else policy, batch)
    trl_reference = torch.tensor([[trainer.train_dataset[int(i)][f"ref_{k}_logps"] for k in ("chosen", "rejected")]
                                  for i in batch["index"]]).flatten()
    torch.testing.assert_close(reference, trl_reference, rtol=1e-6, atol=1e-4)  # (sums of ~60 log-probs)
    fuse_head(policy)
    dpo = Dpo(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items()})
    sums = preference_sums(sequence_logps(policy, batch), reference, batch, dpo)
    mine = window_loss(sums, sums["pairs"], sums["chosen_targets"])
    assert float(mine) == pytest.approx(float(theirs), abs=1e-5, rel=1e-5)
    for name, total in sums["metrics"].items():
        assert float(total) / sums["pairs"] == pytest.approx(metrics[name], abs=1e-5, rel=1e-5), name


def test_packed_equals_one_pair_per_row_and_fused_equals_full_logits(tokenizer, base):
    from memrecipe.training.loss import fuse_head

    rows = text_pairs()
    _, packed = ours(rows, tokenizer)
    _, alone = ours(rows, tokenizer, packing=False)
    assert packed["input_ids"].shape[0] < alone["input_ids"].shape[0] == len(rows)
    assert alone["index"].tolist() == list(range(len(rows)))
    model = copy.deepcopy(base)
    with torch.no_grad():
        plain = sequence_logps(model, alone).view(-1, 2)  # pair i: (chosen, rejected), from the full logits
    fuse_head(model)
    with torch.no_grad():
        fused = sequence_logps(model, packed).view(-1, 2)  # the pairs as the bins ordered them
    torch.testing.assert_close(fused, plain[packed["index"]], rtol=1e-6, atol=1e-4)


def test_a_window_of_uneven_micro_batches_averages_over_its_pairs(tokenizer, base):
    """Micro batches of 1 and 3 packed rows (unequal pairs, unequal chosen tokens), each loss over the WINDOW's counts:
    their gradients sum to one batch of all the pairs' gradient (the sigmoid term over pairs, sft over tokens)."""
    from memrecipe.training.data import IGNORE

    rows = text_pairs(12)
    _, batch = ours(rows, tokenizer, width=96)
    dpo = Dpo(beta=0.1, loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.5))
    policy = perturbed(base)
    reference = reference_logps(base, batch)

    def gradient(micro_batches):
        policy.zero_grad()
        parts = [(b, reference[first:first + b["completion_tokens"].numel()]) for b, first in micro_batches]
        sums = [preference_sums(sequence_logps(policy, b), ref, b, dpo) for b, ref in parts]
        pairs, chosen = sum(x["pairs"] for x in sums), sum(x["chosen_targets"] for x in sums)
        for x in sums:
            window_loss(x, pairs, chosen).backward()
        return torch.cat([p.grad.flatten() for p in policy.parameters()])

    def rows_of(a, b):  # packed rows a..b as a micro batch, and its first document's place in the whole batch
        keys = ("input_ids", "labels", "attention_mask", "position_ids", "document")
        part = {k: batch[k][a:b] for k in keys}
        docs = part["document"][part["document"] >= 0]
        first, last = int(docs.min()), int(docs.max()) + 1
        part["document"] = torch.where(part["document"] >= 0, part["document"] - first, -1)
        part["completion_tokens"], part["index"] = batch["completion_tokens"][first:last], batch["index"][first // 2:last // 2]
        return part, first

    n = batch["input_ids"].shape[0]
    assert n >= 4 and (batch["labels"][:, 1:] != IGNORE).sum(-1).unique().numel() > 1
    whole = gradient([(batch, 0)])
    split = gradient([rows_of(0, 1), rows_of(1, n)])
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-7)


def test_each_preference_loss_is_one_table_entry_with_all_its_parts():
    """PREFERENCE_LOSSES is the list of dpo.loss_type: the schema's names, an implementation by what it compares,
    a check against TRL here, the keys it reads real dpo: keys, and each named in docs/dpo.md and docs/configs.md."""
    import typing
    from dataclasses import fields
    from pathlib import Path

    from memrecipe.planning.recipe import PREFERENCE_LOSSES, DpoLoss
    from memrecipe.training.preference import PAIR_LOSSES

    assert list(typing.get_args(DpoLoss)) == list(PREFERENCE_LOSSES)
    assert set(PAIR_LOSSES) == {n for n, loss in PREFERENCE_LOSSES.items() if loss.reference is True}
    assert set(FREE_LOSSES) == {n for n, loss in PREFERENCE_LOSSES.items() if loss.reference is False}
    compared = {n for c in LOSSES + FREE for n in ([c["loss_type"]] if isinstance(c["loss_type"], str) else c["loss_type"])}
    assert compared == set(PREFERENCE_LOSSES)
    keys = {f.name for f in fields(Dpo)}
    docs = [(Path(__file__).parents[3] / "docs" / page).read_text() for page in ("dpo.md", "configs.md")]
    for name, loss in PREFERENCE_LOSSES.items():
        assert set(loss.reads) <= keys and (loss.reference is not None or loss.chosen_nll), name
        assert all(f"`{name}`" in page for page in docs), name


@pytest.mark.parametrize("words, says", [
    (["dpo.label_smoothing=0.1"], "dpo.label_smoothing=0.1 is read by loss_type robust and simpo only"),
    (["dpo.loss_type=orpo", "dpo.label_smoothing=0.1"], "read by loss_type robust and simpo only, not by orpo"),
    (["dpo.simpo_gamma=1"], "dpo.simpo_gamma=1 is read by loss_type simpo only"),
    (["dpo.loss_type=[simpo,sigmoid]"], "simpo uses no reference model and the others (sigmoid) do"),
    (["dpo.loss_type=orpo", "dpo.precompute_ref_log_probs=true"], "orpo uses no reference model, so there is nothing"),
    (["dpo.loss_type=[sigmoid,ipo]", "dpo.loss_weights=[1]"], "dpo.loss_weights has 1 weight(s) for 2 loss_type(s)"),
    (["dpo.loss_type=sigmod"], "did you mean 'sigmoid'"),
    (["dpo.loss_type=sft"], "sft alone is supervised fine-tuning")])
def test_bad_dpo_keys_are_one_line_naming_the_key(cli, tmp_path, words, says):
    out = cli("config", "single-gpu-lora", "--cpu", "--output-dir", str(tmp_path), *words)
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr


def test_run_sft_refuses_a_dpo_section_before_anything_is_written(cli, tmp_path):
    out = cli("run", "sft", "--recipe", "single-gpu-lora", "--output-dir", str(tmp_path / "run"), "dpo.beta=0.2")
    assert out.returncode == 2 and "run sft does not read the dpo: section" in out.stderr
    assert not (tmp_path / "run").exists()


def trl_batch(tokenized, pad_token_id):
    """TRL's CPO/ORPO batch of the same token ids: chosen_* and rejected_* rows (prompt + completion), right-padded,
    the prompt's tokens masked in the labels (their trainers concatenate and pad them again)."""
    batch = {}
    for side in ("chosen", "rejected"):
        ids = [t["prompt_ids"] + t[f"{side}_ids"] for t in tokenized]
        width = max(map(len, ids))
        batch[f"{side}_input_ids"] = torch.tensor([x + [pad_token_id] * (width - len(x)) for x in ids])
        batch[f"{side}_attention_mask"] = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        batch[f"{side}_labels"] = torch.tensor([[-100] * len(t["prompt_ids"]) + t[f"{side}_ids"] + [-100] * (width - len(x))
                                                for t, x in zip(tokenized, ids)])
    return batch


FREE = [dict(loss_type="simpo", beta=2.0), dict(loss_type="simpo", beta=2.5, simpo_gamma=1.2, label_smoothing=0.1),
        dict(loss_type=["simpo", "sft"], loss_weights=[1.0, 0.7], beta=2.0), dict(loss_type="orpo", beta=0.2)]


@pytest.mark.parametrize("kind", ["full", "lora"])
@pytest.mark.parametrize("config", FREE, ids=["simpo", "simpo-gamma-smoothed", "cpo-simpo", "orpo"])
def test_each_reference_free_loss_and_its_metrics_equal_trls(tokenizer, base, lora_base, tmp_path, kind, config):
    """SimPO against trl.experimental's CPOTrainer (loss_type simpo; its cpo_alpha NLL is our sft weight) and ORPO
    against its ORPOTrainer, through their get_batch_loss_metrics on a padded batch of the same token ids, to 1e-5
    in fp32. ORPO's NLL is the one difference, by design: TRL's covers the prompt's tokens too, ours the chosen
    completion only (the prompt is never a target), so ORPO compares with each side's NLL taken out."""
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from memrecipe.training.loss import fuse_head

    rows = text_pairs()
    policy = perturbed(base if kind == "full" else lora_base)
    tokenized, batch = ours(rows, tokenizer)
    dpo = Dpo(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items()})
    common = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, beta=dpo.beta)
    if "orpo" in dpo.losses:
        trainer_class, args = ORPOTrainer, ORPOConfig(**common)
    else:
        trainer_class, args = CPOTrainer, CPOConfig(
            loss_type="simpo", simpo_gamma=dpo.gamma, label_smoothing=dpo.label_smoothing,
            cpo_alpha=dict(zip(dpo.losses, dpo.weights)).get("sft", 0.0), **common)
    trainer = trainer_class(model=copy.deepcopy(policy), args=args, train_dataset=Dataset.from_list(rows),
                            processing_class=tokenizer)
    trainer.model.train()
    theirs, metrics = trainer.get_batch_loss_metrics(trainer.model, trl_batch(tokenized, tokenizer.pad_token_id))

    fuse_head(policy)
    sums = preference_sums(sequence_logps(policy, batch), None, batch, dpo)
    mine = window_loss(sums, sums["pairs"], sums["chosen_targets"])
    if "orpo" in dpo.losses:  # the odds-ratio term alone, on both sides
        theirs, mine = theirs - metrics["nll_loss"], mine - sums["sft"] / sums["chosen_targets"]
        # a tiny random model's log-probs per token (~ -7) leave log(1 - p) ~ 0: the odds' correction is checked
        # where it matters too, on likely completions (per-token log-probs near 0) through TRL's odds_ratio_loss
        chosen, rejected = torch.tensor([-0.01, -0.3, -0.69, -0.7, -2.0]), torch.tensor([-0.02, -1.5, -0.6, -0.8, -0.1])
        torch.testing.assert_close(FREE_LOSSES["orpo"](chosen, rejected, dpo),
                                   -trainer.odds_ratio_loss(chosen, rejected)[0], rtol=1e-6, atol=1e-7)
    assert float(mine) == pytest.approx(float(theirs), abs=1e-5, rel=1e-5)
    for name, total in sums["metrics"].items():
        assert float(total) / sums["pairs"] == pytest.approx(metrics[name], abs=1e-5, rel=1e-5), name


def test_reference_free_objectives_need_no_reference_so_pissa_and_full_fine_tunes_run_without_one():
    from memrecipe.planning.registry import load_recipe

    pissa = load_recipe("single-gpu-lora", ["lora.init_lora_weights=pissa", "dpo.loss_type=orpo"], script="dpo")
    assert pissa.dpo.reference_free and pissa.lora.init_lora_weights == "pissa"
    full = load_recipe("single-gpu-full", ["dpo.loss_type=[simpo,sft]", "dpo.precompute_ref_log_probs=false"],
                       script="dpo")
    assert full.dpo.reference_free and full.dpo.gamma == 0.5


def test_pair_columns_map_and_mix_as_sfts_do(tmp_path):
    """A dataset entry's columns: names where prompt, chosen and rejected come from (a template for the prompt);
    a mixture takes a mapped source beside one in TRL's names; a column that is not there is one line."""
    import json

    from memrecipe.errors import RecipeError
    from memrecipe.planning.registry import load_recipe
    from memrecipe.training.preference import load_pairs

    rows = text_pairs(4)
    ours_file, theirs_file = tmp_path / "mine.jsonl", tmp_path / "trl.jsonl"
    ours_file.write_text("\n".join(json.dumps({"q": r["prompt"][:9], "rest": r["prompt"][9:], "good": r["chosen"],
                                               "bad": r["rejected"], "id": i}) for i, r in enumerate(rows)))
    theirs_file.write_text("\n".join(json.dumps(r) for r in rows))
    mapped = "{path: %s, columns: {prompt: '{q}{rest}', chosen: good, rejected: bad}}" % ours_file
    recipe = load_recipe("single-gpu-lora", [f"dataset=[{mapped}, {{path: {theirs_file}}}]", "seed=3"], script="dpo")
    pairs = load_pairs(recipe.dataset, recipe, "train")
    assert sorted(pairs.column_names) == ["chosen", "prompt", "rejected"] and len(pairs) == 8
    assert sorted(map(json.dumps, pairs)) == sorted(json.dumps(r) for r in rows + rows)
    typo = load_recipe("single-gpu-lora", ["dataset=[{path: %s, columns: {chosen: goood}}]" % ours_file], script="dpo")
    with pytest.raises(RecipeError, match=r"columns.chosen: no column 'goood' \(did you mean 'good'\?\)"):
        load_pairs(typo.dataset, typo, "train")


def test_a_saved_adapter_loads_as_the_start_and_its_frozen_copy_is_the_reference(tokenizer, tmp_path):
    """The loop's setup on a saved adapter (recipes/sft.py's setup_model): the adapter's weights are the trainable
    start; under dpo a frozen copy sits beside it, and `reference_weights` computes with it (= the policy before a
    step, unlike the adapters off) and leaves what trains as it was; under sft there is no copy."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from helpers import loop_model

    from memrecipe.planning.registry import load_recipe
    from memrecipe.training.preference import reference_weights

    saved = get_peft_model(AutoModelForCausalLM.from_pretrained(embedded_model()),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    for name, p in saved.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)  # an adapter that changes the model (peft starts B at 0)
    saved.save_pretrained(tmp_path / "adapter")
    words = [f"model_name_or_path={tmp_path / 'adapter'}", "lora.dropout=0"]
    model, _ = loop_model(load_recipe("single-gpu-lora", words, script="dpo"), embedded_model())
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trains and all(".default." in n for n in trains) and list(model.peft_config) == ["default", "reference"]
    weights = {k.replace(".weight", ".default.weight"): v for k, v in
               load_file(tmp_path / "adapter" / "adapter_model.safetensors").items()}
    state = model.state_dict()
    assert all(torch.equal(state[k].float(), v.float()) for k, v in weights.items())
    _, batch = ours(text_pairs(), tokenizer)
    with torch.no_grad():
        policy = sequence_logps(model, batch)
        with reference_weights(model):
            reference = sequence_logps(model, batch)
        with model.disable_adapter():
            base = sequence_logps(model, batch)
    torch.testing.assert_close(reference, policy, rtol=0, atol=0)
    assert (policy - base).abs().max() > 0.1
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trains
    sft, _ = loop_model(load_recipe("single-gpu-lora", words, script="sft"), embedded_model())
    assert list(sft.peft_config) == ["default"] and sum(p.requires_grad for p in sft.parameters()) == len(trains)


def ultrafeedback(pairs):
    """The same pairs in HuggingFaceH4/ultrafeedback_binarized's layout: a text prompt, and chosen and rejected as
    whole conversations that repeat it as their first turn."""
    return [{"prompt": p["prompt"][0]["content"], "chosen": p["prompt"] + p["chosen"],
             "rejected": p["prompt"] + p["rejected"]} for p in pairs]


def test_ultrafeedbacks_layout_and_sharegpts_turns_tokenize_as_the_explicit_prompt_form(tokenizer):
    """TRL's maybe_extract_prompt: beside whole conversations the text prompt is left aside for the turns they share;
    ShareGPT's {from, value} turns are the same messages."""
    explicit = [tokenize_pair(p, tokenizer, MAX_LENGTH) for p in chat_pairs()]
    sharegpt = [{key: [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in turns]
                 for key, turns in p.items()} for p in chat_pairs()]
    for layout in (ultrafeedback(chat_pairs()), sharegpt):
        assert [tokenize_pair(p, tokenizer, MAX_LENGTH) for p in layout] == explicit
    trl_form = [trl.data_utils.maybe_extract_prompt(p) for p in ultrafeedback(chat_pairs())]
    assert [p["prompt"] for p in trl_form] == [p["prompt"] for p in chat_pairs()]


BAD_PAIRS = {  # file -> (its rows, what the one line says)
    "numbers": ([{"prompt": "Hi", "chosen": 1, "rejected": 2}], "row 1: chosen is int 1: give text, or a list of"),
    "dicts": ([{"prompt": "Hi", "chosen": {"text": " a"}, "rejected": {"text": " b"}}], "row 1: chosen is dict"),
    "turns": ([{"prompt": "Hi", "chosen": [{"speaker": "bot", "text": "a"}], "rejected": [{"speaker": "bot",
                                                                                          "text": "b"}]}],
              "row 1: chosen: message 1 is dict {'speaker': 'bot', 'text': 'a'}: each message needs role and content"),
    "role": ([{"prompt": [{"role": "user", "content": "Hi"}], "chosen": [{"role": "bot", "content": "a"}],
               "rejected": [{"role": "assistant", "content": "b"}]}], "row 1: chosen: message 1 has role 'bot'"),
    "no-prompt": ([{"chosen": "Yes.", "rejected": "No."}, {"chosen": "A.", "rejected": "B."}],
                  "no pair has a prompt: give a prompt column"),
    "too-long": ([{"prompt": "word " * 400, "chosen": " a.", "rejected": " b."}] * 2,
                 "no pair of its 2 keeps a completion token within dpo.max_length=128 (the prompt alone fills it)"),
}


def test_bad_pair_data_is_one_line_before_anything_is_written(tmp_path, capsys):
    """Through `memrecipe run dpo` (in process): each bad file refused in preflight, exit 2, no folder."""
    import json

    from memrecipe.main import main

    for name, (rows, says) in BAD_PAIRS.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(json.dumps(row) for row in rows))
        with pytest.raises(SystemExit) as done:
            main(["run", "dpo", "--recipe", "single-gpu-lora", "--dataset", str(path), "--output-dir",
                  str(tmp_path / name), "eval_size=0"])
        said = capsys.readouterr().err
        assert done.value.code == 2 and says in said and "Traceback" not in said and len(said.splitlines()) == 1, \
            (name, said)
        assert not (tmp_path / name).exists()
