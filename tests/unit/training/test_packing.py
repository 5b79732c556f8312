"""Packing is exact: whole documents share a row, and each is computed as if it were alone."""

import pytest
import torch

from helpers import loop_model
from memrecipe.training.data import IGNORE, Collator, bins, pack
from memrecipe.training.loss import count_targets, fuse_head, lm_loss, model_inputs, output_head
from memrecipe.training.loading import embedded_model
from memrecipe.planning.registry import load_recipe

LENGTHS = [5, 9, 3, 12, 7, 4, 16, 2]


def test_bins_hold_every_document_once_and_fill_rows():
    rows = bins(LENGTHS, 16)
    assert sorted(i for row in rows for i in row) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in row) <= 16 for row in rows)
    assert len(rows) == -(-sum(LENGTHS) // 16)  # 58 tokens: 4 rows, the fewest that can hold them
    lengths = torch.randint(1, 257, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = bins(lengths, 256)
    assert len(rows) <= 1.02 * sum(lengths) / 256 + 1  # nearly every row full


def documents(vocab=500):
    g = torch.Generator().manual_seed(0)
    docs = []
    for n in LENGTHS:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        labels = [IGNORE] * (n // 3) + ids[n // 3:]  # a prompt, then the completion
        docs.append({"input_ids": ids, "labels": labels})
    return docs


def packed_batch(docs, width=16):
    from datasets import Dataset

    ds = pack(Dataset.from_list(docs), width)
    return Collator(pad_token_id=0)(list(ds)), ds


def test_pack_restarts_positions_and_keeps_every_target():
    docs = documents()
    batch, ds = packed_batch(docs)
    assert sorted(len(ids) for ids in ds["input_ids"]) == sorted(sum(LENGTHS[i] for i in r) for r in bins(LENGTHS, 16))
    for row in ds:
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
        assert all(row["labels"][s] == IGNORE for s in starts)  # nothing predicts a document's first token
    alone = sum(count_targets({"labels": torch.tensor([d["labels"]])}) for d in docs)
    assert count_targets(batch) == alone
    assert int(batch["attention_mask"].sum()) == sum(LENGTHS)  # padding is not counted as real tokens
    assert "attention_mask" not in model_inputs(batch) and model_inputs(batch)["use_cache"] is False


@pytest.fixture(scope="module")
def model():
    recipe = load_recipe("single-gpu-lora", ["lora=null", "mixed_precision=no", "gradient_checkpointing=false"])
    model, _ = loop_model(recipe, embedded_model(), "no")
    return model.train()


def segments(batch):
    """(row, start, end) of each document in a packed batch, padding left out."""
    out = []
    for r, positions in enumerate(batch["position_ids"].tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        real = int(batch["attention_mask"][r].sum())
        out += [(r, s, e) for s, e in zip(starts, starts[1:]) if s < real]
    return out


def test_each_packed_document_is_computed_as_if_alone(model):
    docs = documents()
    batch, _ = packed_batch(docs)
    with torch.no_grad():
        packed = model(**model_inputs(batch)).logits
        crossing = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         attention_mask=batch["attention_mask"]).logits
    by_ids = {tuple(d["input_ids"]): d for d in docs}
    shared = 0
    for r, s, e in segments(batch):
        doc = by_ids[tuple(batch["input_ids"][r, s:e].tolist())]
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([doc["input_ids"]])).logits[0]
        torch.testing.assert_close(packed[r, s:e], alone, atol=1e-5, rtol=1e-5)
        if s > 0:  # a document after another in its row: attention or positions crossing would show here
            shared += 1
            assert (crossing[r, s:e] - alone).abs().max() > 1e-2  # with the padding mask they do cross
    assert shared >= 2


def test_packed_loss_and_gradients_equal_the_documents_alone(model):
    fuse_head(model)
    docs = documents()
    batch, _ = packed_batch(docs)
    model.zero_grad()
    packed = lm_loss(model, batch)
    packed.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone = sum(lm_loss(model, Collator(0)([d])) for d in docs)
    alone.backward()
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():  # 1e-5 of the gradient's scale: sums in another order
        scale = float(p.grad.abs().max())
        torch.testing.assert_close(packed_grads[name], p.grad, atol=1e-5 * scale, rtol=1e-5, msg=name)
    per_row = lm_loss(model, batch, per_sequence=True)
    assert float(per_row.sum()) == pytest.approx(float(packed), rel=1e-5)


@pytest.mark.parametrize("implementation, flattened", [
    ("flash_attention_2", True), ("flash_attention_3", True), ("kernels-community/flash-attn2", True),
    ("sdpa", False), ("eager", False), ("flex_attention", False)])
def test_only_varlen_attention_gets_a_packed_micro_batch_as_one_row(implementation, flattened):
    """transformers' flash path sees packed documents only in a batch of one row (_is_packed_sequence); sdpa and
    eager build a block-diagonal mask per row, where one flattened row would make a (B x S)^2 mask."""
    from types import SimpleNamespace

    from memrecipe.training.loss import varlen

    model = SimpleNamespace(module=SimpleNamespace(config=SimpleNamespace(_attn_implementation=implementation)))
    assert varlen(model) is flattened  # (through an engine's .module)
    batch, _ = packed_batch(documents())
    rows, width = batch["input_ids"].shape
    inputs = model_inputs(batch, flatten=varlen(model))
    assert inputs["input_ids"].shape == inputs["position_ids"].shape == ((1, rows * width) if flattened else (rows, width))
    assert torch.equal(inputs["position_ids"].reshape(rows, width), batch["position_ids"])
    if flattened:  # flash-attn's varlen arguments, once a micro batch: each document (and each row's padding) a sequence
        starts = (inputs["position_ids"][0] == 0).nonzero().squeeze(1).tolist()
        assert inputs["cu_seq_lens_q"].tolist() == inputs["cu_seq_lens_k"].tolist() == starts + [rows * width]
        longest = max(b - a for a, b in zip(starts, starts[1:] + [rows * width]))
        assert inputs["max_length_q"] == inputs["max_length_k"] == longest and isinstance(longest, int)
    else:
        assert "cu_seq_lens_q" not in inputs
    unpacked = Collator(0)(documents()[:3])
    assert model_inputs(unpacked, flatten=True)["input_ids"].shape == unpacked["input_ids"].shape  # padded rows stay


@pytest.mark.parametrize("fused", [True, False])
def test_a_flattened_packed_micro_batch_gives_the_same_loss_and_gradients(monkeypatch, fused):
    """The flattened call (what FA2/FA3 get) through sdpa on CPU, which reads one row's documents from position_ids
    too: loss, per-row eval losses and gradients equal the [B, S] call's."""
    from memrecipe.training import loss

    recipe = load_recipe("single-gpu-lora", ["lora=null", "mixed_precision=no", "gradient_checkpointing=false",
                                             f"fused_loss={str(fused).lower()}"])
    model, _ = loop_model(recipe, embedded_model(), "no")
    assert hasattr(output_head(model), "memrecipe_targets") == fused  # the loop's setup fused the head, or not
    batch, _ = packed_batch(documents(), width=24)
    assert batch["input_ids"].shape[0] >= 3
    results = []
    for flatten in (False, True):
        calls = []
        monkeypatch.setattr(loss, "varlen", lambda m: flatten)  # noqa: B023  (called within this iteration)
        hook = model.model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape),  # noqa: B023
                                                     with_kwargs=True)
        model.zero_grad()
        total = lm_loss(model, batch)
        total.backward()
        per_row = lm_loss(model, batch, per_sequence=True).detach()
        hook.remove()
        assert calls[0][0] == (1 if flatten else batch["input_ids"].shape[0])  # the call really was flattened (or not)
        results.append((total.detach(), per_row, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, plain_rows, plain_grads), (flat, flat_rows, flat_grads) = results
    torch.testing.assert_close(flat, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flat_rows, plain_rows, atol=1e-5, rtol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(flat_grads[name], grad, atol=1e-5 * float(grad.abs().max()), rtol=1e-5, msg=name)
