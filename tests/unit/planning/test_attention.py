"""attn_implementation: auto picks the kernel for the machine (flash-attn's varlen, flex_attention's block-sparse
mask, or sdpa), the run says which, and the planner plans what it picks."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from helpers import loop_model
from memrecipe.errors import RecipeError
from memrecipe.planning.activations import activation_bytes, activation_mode
from memrecipe.planning.architecture import read_config, structure
from memrecipe.planning.attention import pick_attention
from memrecipe.planning.planner import estimate
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology
from memrecipe.training.loading import attention, embedded_model
from unit.training.test_packing import documents, packed_batch, segments


@pytest.mark.parametrize("facts, picked", [
    (dict(cuda=True, half=True, packing=True, flash=True, flex=True), "flash_attention_2"),
    (dict(cuda=True, half=True, packing=False, flash=True, flex=True), "flash_attention_2"),
    (dict(cuda=True, half=False, packing=True, flash=True, flex=True), "flex_attention"),  # flash-attn: 16 bits only
    (dict(cuda=True, half=True, packing=True, flash=False, flex=True), "flex_attention"),
    (dict(cuda=True, half=True, packing=False, flash=False, flex=True), "sdpa"),  # causal sdpa, or a padding mask
    (dict(cuda=True, half=True, packing=True, flash=False, flex=False), "sdpa"),  # no Triton, or attention dropout
    (dict(cuda=False, half=True, packing=True, flash=True, flex=True), "sdpa"),  # CPU: no flex backward
    (dict(cuda=True, half=True, packing=False, flash=False, flex=True, windowed=True), "flex_attention"),  # no mask
    (dict(cuda=True, half=True, packing=False, flash=True, flex=True, windowed=True), "flash_attention_2"),
    (dict(cuda=True, half=True, packing=False, flash=False, flex=False, windowed=True), "sdpa"),
    (dict(cuda=True, half=True, packing=False, flash=False, flex=True, sdpa=False), "flex_attention"),  # Gemma 2
    (dict(cuda=True, half=True, packing=False, flash=False, flex=False, sdpa=False), "eager"),
    (dict(cuda=False, half=True, packing=False, flash=False, flex=False, sdpa=False), "eager"),
])
def test_auto_picks_the_fastest_kernel_that_can_run(facts, picked):
    assert pick_attention("auto", **facts).name == picked
    assert pick_attention("eager", **facts).name == "eager"  # a named kernel is taken as asked


def cuda_facts(monkeypatch, flash: bool, triton: bool):
    """This machine as a CUDA one with or without flash-attn and Triton: transformers' own flash check and the
    Triton lookup patched (the loop's `attention` reads both)."""
    import transformers.utils

    from memrecipe.training import loading

    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: flash)
    monkeypatch.setattr(loading, "flash_import_error", lambda: None)  # (a flash-attn that imports)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (object() if triton else None)
                        if name == "triton" else find_spec(name, *a))  # (either way, whatever is installed here)


@pytest.mark.parametrize("flash, triton, packing, picked", [
    (True, True, True, "flash_attention_2"), (False, True, True, "flex_attention"), (False, False, True, "sdpa"),
    (False, True, False, "sdpa")])
def test_the_loop_resolves_auto_from_what_is_installed(monkeypatch, tmp_path, flash, triton, packing, picked):
    cuda_facts(monkeypatch, flash, triton)
    recipe = load_recipe("single-gpu-lora", [f"packing={str(packing).lower()}"])
    assert recipe.attn_implementation == "auto"
    kernel = attention(recipe, embedded_model(), "bf16", torch.device("cuda"))
    assert kernel.name == picked, kernel
    assert attention(recipe, embedded_model(), "bf16", torch.device("cpu")).name == "sdpa"
    # a model whose attention has dropout cannot train under transformers' flex path: sdpa instead
    import shutil

    folder = tmp_path / "dropout"
    shutil.copytree(embedded_model(), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"attention_dropout": 0.1}))
    assert attention(recipe, str(folder), "bf16", torch.device("cuda")).name == \
        ("flash_attention_2" if flash else "sdpa")


def test_the_planner_plans_the_kernel_auto_picks():
    """On a GPU without flash-attn auto runs flex_attention over packed rows: no dense mask, no K/V copies, its
    BlockMask. sdpa under the packed rows' mask holds both in every layer; flash-attn's varlen kernel neither, and
    no BlockMask. All three keep the attention's output once, o_proj reading it. A GPU plan does not depend on what is
    installed where it is made: auto is planned as the worst of what it takes on a GPU box, with flash-attn installed
    (flash_attention_2, whose backward's buffers are the larger) or not (flex_attention), and says which."""
    from memrecipe.planning.attention import block_mask_bytes

    s = structure(read_config(embedded_model()))
    words = ["max_seq_length=2048", "per_device_train_batch_size=2", "gradient_checkpointing=false",
             "lora.dropout=0"]  # (what dropout keeps differs by device: test_activations)
    auto, sdpa, flex, flash = (estimate(load_recipe("single-gpu-lora", [*words, f"attn_implementation={a}"]), s,
                                        Topology(1)) for a in ("auto", "sdpa", "flex_attention", "flash_attention_2"))
    worst, other = (flash, flex) if flash.working > flex.working else (flex, flash)
    assert (auto.attention, sdpa.attention) == (worst.attention, "sdpa") and auto.working == worst.working
    T, a, d, kv = 2 * 2048, s.heads, s.head_dim, s.kv_dim
    per_layer = T * (a * d - kv) * 2 * 2 + 2 * 2048 * 2048 * 2  # K and V repeated, the additive bf16 mask
    blocks = block_mask_bytes("flex_attention", 2, 2048)
    assert blocks == 2 * 16 * 16 * 17
    assert sdpa.activations - flex.activations == s.layers * per_layer - blocks
    assert flash.activations == flex.activations - blocks
    assert any(n.startswith(f"attention: {worst.attention}") and "the worst of what auto takes on a GPU box with "
               f"flash-attn installed or not ({other.attention} holds less" in n for n in auto.notes)
    cpu = estimate(load_recipe("single-gpu-lora", words), s, Topology(1, cpu=True))
    assert cpu.attention == "sdpa" and cpu.activations == sdpa.activations
    # a run's report plans the kernel that ran: auto that fell back to sdpa on a GPU is planned as sdpa
    ran = estimate(load_recipe("single-gpu-lora", words), s, Topology(1), attention="sdpa")
    assert ran.attention == "sdpa" and ran.activations == sdpa.activations


def test_plan_says_which_kernel_it_planned(cli):
    out = cli("plan", "--model", embedded_model(), "--gpu-memory", "24GiB", "--recipe", "single-gpu-lora")
    assert "attention: flex_attention (auto: flash-attn is not installed;" in out.stdout, out.stdout + out.stderr


def test_sdpa_under_a_packed_mask_saves_what_the_planner_says():
    """Autograd's saved bytes with packed rows (a dense mask) minus with one document per row (causal, grouped K/V),
    measured with saved_tensors_hooks: the repeated K/V and the additive mask, in every layer."""
    recipe = load_recipe("single-gpu-lora", ["lora=null", "mixed_precision=no", "gradient_checkpointing=false",
                                             "fused_loss=false"])
    model, _ = loop_model(recipe, embedded_model(), "no")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    b, seq = 2, 48
    ids = torch.randint(3, 500, (b, seq), generator=torch.Generator().manual_seed(0))

    def saved(positions):
        held = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, position_ids=positions, use_cache=False)
        return sum(held.values())

    whole = saved(torch.arange(seq).repeat(b, 1))
    packed = saved(torch.cat([torch.arange(16)] * 3).repeat(b, 1))
    s = structure(read_config(embedded_model()))
    mode = activation_mode(recipe, 4)
    planned = {kernel: activation_bytes(recipe, s, mode, b, seq, kernel)["activations"]
               for kernel in ("sdpa", "flash_attention_2")}
    assert packed - whole > 0
    assert planned["sdpa"] - planned["flash_attention_2"] == packed - whole  # (flash: the plan without a dense mask)


@pytest.mark.slow
def test_flex_attention_keeps_packed_documents_apart():
    """What auto runs on a GPU without flash-attn: transformers' flex path builds its BlockMask from the packed
    rows' position_ids. Forward only (torch 2.13 has no flex backward on CPU): each document's logits equal its
    own, alone, through sdpa. Compiles flex's CPU kernel (~10 s)."""
    recipe = load_recipe("single-gpu-lora", ["lora=null", "mixed_precision=no", "gradient_checkpointing=false",
                                             "attn_implementation=flex_attention"])
    flex, _ = loop_model(recipe, embedded_model(), "no")
    assert flex.config._attn_implementation == "flex_attention"
    sdpa, _ = loop_model(load_recipe("single-gpu-lora", ["lora=null", "mixed_precision=no"]), embedded_model(), "no")
    sdpa.load_state_dict(flex.state_dict())
    batch, _ = packed_batch(documents(), width=16)
    with torch.no_grad():
        packed = flex.eval()(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        crossing = sdpa.eval()(input_ids=batch["input_ids"], use_cache=False).logits  # one document per row
    shared = 0
    for r, s, e in segments(batch):
        with torch.no_grad():
            alone = sdpa(input_ids=batch["input_ids"][r:r + 1, s:e], use_cache=False).logits[0]
        torch.testing.assert_close(packed[r, s:e], alone, atol=1e-4, rtol=1e-4)
        if s > 0:
            shared += 1
            assert (crossing[r, s:e] - alone).abs().max() > 1e-2
    assert shared >= 2


@pytest.mark.parametrize("kernel", ["flex_attention", "flash_attention_2"])
def test_a_cuda_only_kernel_is_refused_on_cpu_before_anything_is_written(cli, tmp_path, kernel):
    out = cli("run", "sft", "--recipe", "single-gpu-lora", "--output-dir", str(tmp_path / "run"),
              f"attn_implementation={kernel}")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"error: attn_implementation={kernel} trains on CUDA only" in out.stderr and "attn_implementation=auto" in out.stderr
    assert not (tmp_path / "run").exists()


def test_a_flash_attn_that_is_found_but_does_not_import_is_not_picked(monkeypatch, tmp_path):
    """A flash-attn wheel built for another torch is found (find_spec, transformers' package check) and dies on
    import: the loop's auto falls back as when it is absent and says why. (The plan does not ask this machine: it
    plans the worst of what auto takes on a GPU box.)"""
    import sys

    import transformers.utils

    for name, body in (("broken", "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')"), ("fine", "")):
        (tmp_path / name / "flash_attn").mkdir(parents=True)
        (tmp_path / name / "flash_attn" / "__init__.py").write_text(body + "\n")
    for name, imports in (("broken", False), ("fine", True)):
        monkeypatch.syspath_prepend(str(tmp_path / name))
        sys.modules.pop("flash_attn", None)
        monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
        kernel = attention(load_recipe("single-gpu-lora"), embedded_model(), "bf16", torch.device("cuda"))
        assert kernel.name == ("flash_attention_2" if imports else "sdpa"), kernel  # (no Triton here: not flex)
        if not imports:
            assert "flash-attn is installed but does not import (ImportError: flash_attn_2_cuda.so: undefined" in kernel.why
        monkeypatch.undo()
    sys.modules.pop("flash_attn", None)


def test_flash_and_sdpa_are_refused_past_their_32_bit_offsets_and_auto_takes_flex():
    """flash-attn 2's backward (to 2.8.3.post1) and torch's copy of its kernel compute the dq accumulator's offset in
    32-bit int: 2^31 / (heads x head dim rounded up to 32) tokens a call. Past it the plan and the run refuse the
    kernel (--force or not: the writes wrap silently), auto takes flex_attention (64-bit offsets), and under Ulysses a
    process attends to 1/sp of the heads, so its call may hold sp times more."""
    from memrecipe.launching.checks import check_fits
    from memrecipe.planning.attention import offset_limit, offsets_note
    from memrecipe.planning.hardware import Machine
    from memrecipe.planning.planner import judge
    from model_configs import LLAMA_8B

    assert offset_limit(32, 128) == 524_288 and offset_limit(4, 128) == 4_194_304
    assert offset_limit(32, 80) == offset_limit(32, 96) and offset_limit(8, 192) == 2**31 // (8 * 192)
    assert offsets_note("flex_attention", 10**7, 32, 128) is None and offsets_note("sdpa", 524_288, 32, 128) is None
    s, one = structure(LLAMA_8B), ["per_device_train_batch_size=1"]
    for kernel in ("sdpa", "flash_attention_2"):
        past = estimate(load_recipe("single-gpu-lora", [*one, "max_seq_length=525000", f"attn_implementation={kernel}"]),
                        s, Topology(1))
        assert "wrap past 524,288 tokens a micro batch at 32 heads x 128" in past.refused
        assert not judge(past, 10**15, None).fits  # not a matter of memory
    auto = estimate(load_recipe("single-gpu-lora", [*one, "max_seq_length=525000"]), s, Topology(1))
    assert (auto.attention, auto.refused) == ("flex_attention", None)
    below = estimate(load_recipe("single-gpu-lora", [*one, "max_seq_length=524288", "attn_implementation=sdpa"]),
                     s, Topology(1))
    assert below.refused is None and estimate(load_recipe("single-gpu-lora", [*one, "max_seq_length=525000",
                                              "attn_implementation=sdpa"]), s, Topology(1, cpu=True)).refused is None
    ulysses = load_recipe("zero3-ulysses", ["model_name_or_path=org/model", *one])
    assert estimate(ulysses, s, Topology(8), seq_length=4_194_304).refused is None
    assert "at 4 heads x 128" in estimate(ulysses, s, Topology(8), seq_length=4_195_328).refused
    gpu = Machine(gpus=1, gpu_memory=10**15, bf16=True, cores=16, host_memory=2**50)
    words = [*one, "max_seq_length=600000", "attn_implementation=sdpa"]
    with pytest.raises(RecipeError, match="recipe single-gpu-lora: attention: sdpa's backward addresses its dq "
                                          "accumulator with 32-bit offsets.*use attn_implementation=flex_attention"):
        check_fits(load_recipe("single-gpu-lora", words), Topology(1), gpu, words, force=True, shape=s)


def test_sdpa_in_query_chunks_runs_past_its_offsets_and_the_8b_reaches_the_goals():
    """Under query_chunks one call of sdpa's kernel holds a chunk of queries (its keys are addressed in 64 bits, and
    torch launches the key-parallel backward only): past 524,288 tokens sdpa is planned, not refused, unless the chunk
    itself passes the limit. On one 80 GB GPU (80e9 bytes) `plan --longest` under sdpa named climbs to query chunks
    and Llama-3.1-8B reaches the issue's goals, 700K with LoRA r16 and 800K with QLoRA r32 (as shipped, dropout
    0.05), where sdpa whole stops at its offsets with memory to spare."""
    from memrecipe.planning.ladder import STEP, longest, longest_per_recipe
    from memrecipe.planning.planner import judge
    from model_configs import LLAMA_8B

    s, one = structure(LLAMA_8B), ["per_device_train_batch_size=1", "packing=false", "attn_implementation=sdpa"]
    top = [*one, "activation_offload=true", "lean_norms=true", "tiled_mlp=true"]
    chunked = estimate(load_recipe("single-gpu-lora", [*top, "max_seq_length=700000", "query_chunks=true"]), s,
                       Topology(1))
    assert chunked.refused is None and judge(chunked, 80 * 10**9, None).fits
    wide = estimate(load_recipe("single-gpu-lora", [*top, "max_seq_length=800000", "query_chunks=600000"]), s,
                    Topology(1))
    assert "wrap past 524,288 tokens a micro batch" in wide.refused
    whole, _ = longest(load_recipe("single-gpu-lora", top), s, Topology(1), 80 * 10**9, None)
    assert whole == 512 * STEP  # the offsets, not the memory
    lora = longest_per_recipe(load_recipe("single-gpu-lora", one), s, Topology(1), 80 * 10**9, None)
    qlora = longest_per_recipe(load_recipe("qlora", [*one, "lora.r=32"]), s, Topology(1), 80 * 10**9, None)
    assert (lora.rung.name, qlora.rung.name) == ("query chunks", "query chunks")
    assert lora.seq_length >= 700 * STEP and qlora.seq_length >= 800 * STEP, (lora.seq_length, qlora.seq_length)


def test_the_loop_refuses_a_kernel_past_its_offsets_and_auto_takes_flex(monkeypatch):
    """What a plain accelerate launch meets on the GPU box (memrecipe run refused it before): the embedded model's
    4 heads x 32 wrap past 2^31 / 128 = 16,777,216 tokens a micro batch; sdpa in query chunks runs past them."""
    cuda_facts(monkeypatch, flash=True, triton=True)
    words = ["per_device_train_batch_size=2", "max_seq_length=8388609"]
    with pytest.raises(RecipeError, match="flash_attention_2's backward addresses its dq accumulator with 32-bit offsets"):
        attention(load_recipe("single-gpu-lora", [*words, "attn_implementation=flash_attention_2"]), embedded_model(),
                  "bf16", torch.device("cuda"))
    assert attention(load_recipe("single-gpu-lora", words), embedded_model(), "bf16", torch.device("cuda")).name == \
        "flex_attention"
    one = ["per_device_train_batch_size=1", "max_seq_length=16777217", "attn_implementation=sdpa", "packing=false"]
    with pytest.raises(RecipeError, match="sdpa's backward addresses its dq accumulator with 32-bit offsets"):
        attention(load_recipe("single-gpu-lora", one), embedded_model(), "bf16", torch.device("cuda"))
    chunked = load_recipe("single-gpu-lora", [*one, "query_chunks=true"])  # a call holds a chunk of queries
    assert attention(chunked, embedded_model(), "bf16", torch.device("cuda")).name == "sdpa"
    assert attention(load_recipe("single-gpu-lora", words[:1]), embedded_model(), "bf16", torch.device("cuda")).name == \
        "flash_attention_2"


def windowed_model(tmp_path, kind: str = "mistral", **config) -> str:
    """The embedded Llama as another family (Mistral's sliding window of 256 keys, or Gemma 2), its tokenizer
    beside it: a model folder the loop and the planner read."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    embedded = Path(embedded_model())
    base = json.loads((embedded / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    folder = tmp_path / kind
    AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **{k: base[k] for k in keep if k in base}, **config)
                                     ).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(embedded / name, folder)
    return str(folder)


@pytest.mark.parametrize("flash, triton, length, picked", [
    (False, True, 512, "flex_attention"), (False, True, 128, "sdpa"), (True, True, 512, "flash_attention_2"),
    (False, False, 512, "sdpa")])
def test_past_a_sliding_window_auto_takes_a_kernel_without_a_dense_mask(monkeypatch, tmp_path, flash, triton, length,
                                                                         picked):
    """A Mistral with a 256-key window: past it transformers gives sdpa a dense [S x S] mask in every layer
    (planning.attention.dense_mask), so on a GPU auto takes flex_attention (the window folded into its BlockMask)
    where flash-attn is not installed; below the window sdpa runs causal, as for any model. The planner, planning
    the worst of a GPU box with flash-attn installed or not, plans no dense mask past the window either."""
    folder = windowed_model(tmp_path, sliding_window=256)
    cuda_facts(monkeypatch, flash, triton)
    recipe = load_recipe("single-gpu-lora", [f"max_seq_length={length}", "packing=false", "per_device_train_batch_size=1"])
    assert attention(recipe, folder, "bf16", torch.device("cuda")).name == picked
    if length > 256:
        assert estimate(recipe, structure(read_config(folder)), Topology(1)).attention in ("flex_attention",
                                                                                            "flash_attention_2")


def test_under_query_chunks_a_sliding_window_keeps_no_dense_mask():
    """Query chunks give a windowed layer's rows no mask (training.query_chunks.windowless_mask) and run each chunk
    against the keys its window reaches: past Mistral's window the plan keeps none of sdpa's [S x S] masks (2 GiB a
    layer at 32K tokens, and the note naming the kernels that keep none), as much as the same model without a
    window, and a step faster than its causal half (the band alone, on a GPU); below a chunk's length, one call."""
    from model_configs import LLAMA_8B

    from memrecipe.planning.attention import chunked

    llama, mistral = (structure(LLAMA_8B | extra) for extra in ({}, {"model_type": "mistral", "sliding_window": 4096}))
    words = ["model_name_or_path=org/model", "per_device_train_batch_size=1", "attn_implementation=sdpa",
             "packing=false"]
    whole, chunks = (load_recipe("single-gpu-lora", [*words, *extra]) for extra in ([], ["query_chunks=4096"]))
    plans = {(r is chunks, s.model_type): estimate(r, s, Topology(1), seq_length=32768)
             for r in (whole, chunks) for s in (llama, mistral)}
    masked, banded, causal = plans[False, "mistral"], plans[True, "mistral"], plans[True, "llama"]
    assert masked.activations - causal.activations >= 32768**2 * 2  # (at least one layer's additive bf16 mask)
    assert any("dense mask" in n for n in masked.notes) and not any("dense mask" in n for n in banded.notes)
    assert (banded.activations, banded.working) == (causal.activations, causal.working)
    assert banded.step_seconds < causal.step_seconds
    assert chunked(4096, "sdpa", False, 1, 6000, 4096) == 4096
    assert chunked(8192, "sdpa", False, 1, 6000, 4096) == 6000  # (one call over the bands: a row past its window)
    assert chunked(8192, "sdpa", False, 1, 6000, 0) == chunked(8192, "sdpa", False, 1, 4000, 4096) == 0
    assert chunked(8192, "sdpa", True, 1, 32768, 4096) == 0  # (packed: the documents' mask, sdpa whole)


def test_a_kernel_the_models_class_has_no_path_for_is_refused_in_one_line_and_auto_avoids_it(monkeypatch, tmp_path):
    """Gemma 2's transformers class has no sdpa path (it soft-caps its scores): auto takes eager on CPU and
    flex_attention on a GPU without flash-attn, in the loop and the plan alike, and a recipe naming sdpa is refused
    at plan and at load in one line naming the kernels it has (it was transformers' ValueError, a traceback, at
    load). GPT-2's class has no flex_attention path."""
    folder = windowed_model(tmp_path, "gemma2", head_dim=32, sliding_window=256)
    s = structure(read_config(folder))
    auto = load_recipe("single-gpu-lora", ["max_seq_length=512", "per_device_train_batch_size=1"])
    assert attention(auto, folder, "bf16", torch.device("cpu")).name == "eager"
    assert estimate(auto, s, Topology(1, cpu=True)).attention == "eager"
    named = load_recipe("single-gpu-lora", ["attn_implementation=sdpa"])
    with pytest.raises(RecipeError, match="transformers has no sdpa path for gemma2.*attn_implementation="
                                          "flash_attention_2 or flex_attention or eager"):
        attention(named, folder, "bf16", torch.device("cpu"))
    assert "no sdpa path for gemma2" in estimate(named, s, Topology(1)).refused
    cuda_facts(monkeypatch, False, True)
    assert attention(auto, folder, "bf16", torch.device("cuda")).name == "flex_attention"
    assert estimate(auto, s, Topology(1)).attention == "flex_attention"
    gpt2 = structure({"model_type": "gpt2", "n_embd": 64, "n_head": 2, "n_layer": 2, "vocab_size": 100, "n_positions": 64})
    flex = load_recipe("single-gpu-lora", ["attn_implementation=flex_attention", "lora.target_modules=[c_attn]"])
    assert "no flex_attention path for gpt2" in estimate(flex, gpt2, Topology(1)).refused


def test_a_model_with_attention_dropout_is_planned_without_flex_and_refused_query_chunks():
    """transformers' flex path and the query chunks run no attention dropout: the loop's auto does not take flex for
    such a model (training.loading.attention), so the plan does not either (packed rows on a GPU without flash-attn:
    sdpa under the mask), and the query chunks rung is refused before launch as at load."""
    from model_configs import LLAMA_8B

    dropped = structure(LLAMA_8B | {"attention_dropout": 0.1})
    assert dropped.attention_dropout == 0.1 and structure(LLAMA_8B).attention_dropout == 0
    packed = load_recipe("single-gpu-lora", ["packing=true", "max_seq_length=8192"])
    assert estimate(packed, structure(LLAMA_8B), Topology(1)).attention in ("flex_attention", "flash_attention_2")
    e = estimate(packed, dropped, Topology(1))
    assert e.attention == "sdpa" and "flex_attention" not in " ".join(e.notes)
    chunks = load_recipe("single-gpu-lora", ["attn_implementation=sdpa", "packing=false", "query_chunks=4096",
                                             "max_seq_length=32768", "per_device_train_batch_size=1"])
    assert "query_chunks runs attention without dropout; this model's attention_dropout is 0.1" in \
        estimate(chunks, dropped, Topology(1)).refused
    assert estimate(chunks, structure(LLAMA_8B), Topology(1)).refused is None
