"""planning/planner.py: the estimate as a whole (the 8B jobs against torchtune's measured peaks, a step's working
memory, a DPO step's rows) and what it refuses. Its parts: test_states.py (model states), test_activations.py."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from helpers import loop_model
from memrecipe.errors import RecipeError
from memrecipe.planning.architecture import read_config, structure
from memrecipe.planning.planner import breakdown, estimate
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology
from memrecipe.training.loss import fuse_head, lm_loss
from model_configs import LLAMA_8B, MEDIUM, MOE_LORA

CPU1 = Topology(1, cpu=True)


# --- the lean loss and lean QLoRA: what a Llama-3.1-8B job plans, and the step's measured peak ----

TORCHTUNE_JOB = ["per_device_train_batch_size=2", "max_seq_length=2048", "lora.r=8", "lora.alpha=16",
                 "lora.dropout=0"]  # torchtune's llama3_1 8B lora/qlora configs: lora_dropout 0.0


@pytest.mark.parametrize("recipe, overrides, offload, without_offload", [
    ("single-gpu-lora", ["lora.target_modules=[q_proj,v_proj]"], 16.2, 17.0),  # torchtune on a 4090: 16.2 GiB
    ("qlora", [], 7.4, 8.0),  # torchtune: 7.4 GiB (LoRA on every linear layer)
])
def test_an_8b_job_plans_no_more_than_torchtune_measures(recipe, overrides, offload, without_offload):
    s = structure(LLAMA_8B)
    for knob, bound in ((True, offload), (False, without_offload)):
        r = load_recipe(recipe, [*TORCHTUNE_JOB, *overrides, f"activation_offload={str(knob).lower()}"])
        est = estimate(r, s, Topology(1))
        assert (est.total - est.overhead) / 2**30 <= bound, (knob, est)
        plain = estimate(load_recipe(recipe, [*TORCHTUNE_JOB, *overrides, "fused_loss=false"]), s, Topology(1))
        assert plain.logits > 6 * est.logits  # 4.9 GiB of logits, vs one 512-token chunk's 0.6
    if recipe == "qlora":  # 16-bit embeddings and head, as the quantized base stores them
        upcast = estimate(load_recipe(recipe, [*TORCHTUNE_JOB, "quantization.upcast_unquantized=true"]), s, Topology(1))
        assert upcast.parameters - est.parameters == 2 * (s.params - s.layers * sum(lin.params for lin in s.linears))


@pytest.mark.parametrize("overrides, bound", [
    ([], 40),  # torchao's 8-bit AdamW (embeddings' state in fp32), the step in backward
    (["optim=apollo_adamw", "optim_args.rank=128"], 24),  # every linear layer, lm_head included, projected
])
def test_an_8b_full_fine_tune_plans_on_one_gpu(overrides, bound):
    """Llama-3.1-8B, 2 x 2048, one GPU, model states on it (today's adamw-8bit: ~80 GiB)."""
    s = structure(LLAMA_8B)
    r = load_recipe("single-gpu-full", ["per_device_train_batch_size=2", "max_seq_length=2048", *overrides])
    est = estimate(r, s, Topology(1))
    assert (est.total - est.overhead) / 2**30 <= bound, breakdown(est)
    assert est.host_total() < 16 * 2**30 and est.host_offload == 0  # nothing parked in host RAM
    assert est.parameters == 2 * s.params and est.gradients == 2 * s.vocab * s.hidden  # bf16; the head's gradient
    ordinary = estimate(replace(r, optimizer_in_backward=False), s, Topology(1))
    assert ordinary.gradients == 2 * s.params  # a model's worth of bf16 gradients without the step in backward
    stock = estimate(load_recipe("adamw-8bit", ["per_device_train_batch_size=2", "max_seq_length=2048"]), s, Topology(1))
    assert stock.total > 75 * 2**30


@pytest.mark.slow
@pytest.mark.parametrize("recipe, overrides", [
    ("single-gpu-lora", []), ("single-gpu-lora", ["fused_loss=false"]),
    ("single-gpu-lora", ["gradient_checkpointing=false"]),
    ("single-gpu-lora", ["gradient_checkpointing=false", "fused_loss=false"]),
])
def test_the_steps_peak_is_what_the_planner_calls_working_memory(models, recipe, overrides):
    """A whole forward and backward, every allocation recorded by the profiler: with checkpointing the
    loss and a layer's recompute peak at different moments (the larger counts); without it, together.
    LoRA, so that the gradients (the adapters') are small beside what is measured. (A full fine-tune's
    gradients peak at the end of backward, not with the loss: the planner's sum is conservative there.)"""
    from measuring import allocation_peak_of

    B, S = 2, 256
    r = load_recipe(recipe, [*overrides, f"per_device_train_batch_size={B}", f"max_seq_length={S}"])
    model, _ = loop_model(r, models["medium"], "bf16")
    if r.fused_loss:
        fuse_head(model)
    model.train()  # checkpointing and dropout act in training mode only
    ids = torch.randint(0, MEDIUM["vocab_size"], (B, S), generator=torch.Generator().manual_seed(0))
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, b)
        loss.backward()

    peak = allocation_peak_of(step)
    est = estimate(r, structure(read_config(models["medium"])), CPU1)
    assert est.working + est.gradients == pytest.approx(peak, rel=0.1)
    assert est.working < est.activations + est.logits or not r.gradient_checkpointing


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [[], ["gradient_checkpointing=false"]])
def test_a_dpo_steps_peak_is_what_the_planner_plans_for_its_rows(models, overrides):
    """A preference micro batch as recipes/dpo.py runs it (the reference pass with the adapters off, under no_grad,
    then the policy's sequence log-probs, the loss, backward) over 2 packed rows of the embedded pairs, every
    allocation profiled: the reference's forward is over before the policy's starts, so the step holds what an
    SFT step over the same rows holds, and the planner plans it so. (Chunks of 64 target tokens: the pairs' targets
    are their completions, fewer than the plan's every-token-a-target, and the chunk is then the same size.)"""
    import json
    import sys

    from datasets import Dataset

    from helpers import REPO
    from measuring import allocation_peak_of
    from memrecipe.planning.registry import EMBEDDED_PREFERENCES
    from memrecipe.training.loading import embedded_model
    from memrecipe.training.preference import (PairCollator, pack_pairs, preference_sums, sequence_logps, tokenize_pair,
                                               window_loss)
    from memrecipe.training.tokenizer import load_tokenizer

    sys.path.insert(0, str(REPO / "recipes"))
    from dpo import Preference  # the loop's own reference pass

    B, S = 2, 256
    r = load_recipe("single-gpu-lora", [*overrides, f"per_device_train_batch_size={B}", f"max_seq_length={S}",
                                        "loss_chunk_tokens=64", "lora.dropout=0"], script="dpo")
    model, _ = loop_model(r, models["medium"], "bf16")  # the loop's setup: its head fused, in chunks of 64 targets
    model.train()
    tokenizer = load_tokenizer(embedded_model())
    pairs = [tokenize_pair(json.loads(line), tokenizer, S // 2) for line in open(EMBEDDED_PREFERENCES)][:40]
    rows = list(pack_pairs(Dataset.from_list(pairs), S))[:B]
    batch = PairCollator(tokenizer.pad_token_id, multiple=S)(rows)  # rows of S tokens, as the planner plans them
    assert batch["input_ids"].shape == (B, S) and batch["attention_mask"].float().mean() > 0.8
    assert (batch["labels"][:, 1:] != -100).sum() > 64
    dpo = r.dpo

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reference = Preference(r).reference(model, batch, SimpleNamespace(unwrap_model=lambda m: m))
            sums = preference_sums(sequence_logps(model, batch), reference, batch, dpo)
            window_loss(sums, sums["pairs"], 0).backward()

    peak = allocation_peak_of(step)
    est = estimate(r, structure(read_config(models["medium"])), CPU1)
    assert est.working + est.gradients == pytest.approx(peak, rel=0.1)


def test_qlora_and_dropout_on_fused_experts_are_refused_with_the_reason(models, cli):
    s = structure(read_config(models["mixtral"]))
    with pytest.raises(RecipeError, match=r"QLoRA saves little on mixtral, whose experts \(75% of its parameters\)"):
        estimate(load_recipe("qlora", MOE_LORA), s, CPU1)
    with pytest.raises(RecipeError, match="lora.dropout must be 0 for this model"):
        estimate(load_recipe("single-gpu-lora"), s, CPU1)
    done = cli("plan", "--model", models["mixtral"], "--gpu-memory", "24GiB", "--recipe", "qlora")
    assert done.returncode == 2 and "QLoRA saves little" in done.stderr and "Traceback" not in done.stderr


def test_lean_norms_are_planned_where_the_loop_runs_them_and_said_where_it_cannot():
    """Gemma's RMSNorm adds 1 to its weight: lean_norms leaves it as it is, so its plan is the plan without them (and a
    note says why), where a Llama's plan is lower with them."""
    import json

    from memrecipe.planning.architecture import structure
    from memrecipe.planning.registry import EMBEDDED_MODEL, load_recipe

    config = json.loads((EMBEDDED_MODEL / "config.json").read_text())
    words = ["model_name_or_path=/models/x", "max_seq_length=8192", "per_device_train_batch_size=1"]
    plans = {}
    for model_type in ("llama", "gemma"):
        s = structure({**config, "model_type": model_type})
        plans[model_type] = [estimate(load_recipe("single-gpu-lora", [*words, f"lean_norms={lean}"]), s, Topology(1))
                             for lean in ("false", "true")]
    assert plans["llama"][1].activations < plans["llama"][0].activations
    assert plans["gemma"][1].activations == plans["gemma"][0].activations
    assert any("lean_norms: gemma's RMSNorm is not Llama's" in n for n in plans["gemma"][1].notes)
    assert not any("lean_norms" in n for n in plans["llama"][1].notes)


# --- lora.redraw_dropout: auto, decided by the memory ----

def test_auto_dropout_is_peft_s_where_the_run_fits_with_it_and_the_redraw_where_only_it_fits():
    """`lora.redraw_dropout: auto` (the LoRA recipes' default) is decided where a plan is judged: peft's dropout
    (false: each adapter keeps its mask and 16-bit dropped input, no checkpoint of its own) where the step fits with
    it, the redraw (true) where only the redraw fits, and the redraw where nothing fits (the memory-safe choice). The
    lengths come from the planner: the longest each way fits on one 80 GB GPU, at the top rung."""
    from memrecipe.planning.ladder import longest
    from memrecipe.planning.planner import decide_dropout

    s, topo, gpu = structure(LLAMA_8B), Topology(1), 80 * 10**9
    top = ["per_device_train_batch_size=1", "lora.r=16", "gradient_checkpointing=true", "activation_offload=true",
           "lean_norms=true", "tiled_mlp=true", "attn_implementation=flex_attention"]
    auto = load_recipe("single-gpu-lora", top)
    assert auto.lora.redraw_dropout == "auto" and auto.lora.dropout == 0.05  # as shipped
    reach = {value: longest(load_recipe("single-gpu-lora", [*top, f"lora.redraw_dropout={value}"]), s, topo, gpu,
                            None)[0] for value in ("false", "true")}
    assert 0 < reach["false"] < reach["true"]  # peft's masks cost memory at long context
    for length, decided in ((reach["false"], False), (reach["true"], True)):
        r, verdict = decide_dropout(auto, s, topo, gpu, None, seq_length=length)
        assert r.lora.redraw_dropout is decided and verdict.fits, length
        assert verdict.estimate.redraws_dropout is decided
        assert verdict.estimate.total == estimate(r, s, topo, seq_length=length).total  # the decided one's plan
        assert any(n.startswith("lora.redraw_dropout: auto redraws") for n in verdict.estimate.notes) is decided
    r, verdict = decide_dropout(auto, s, topo, gpu, None, seq_length=2 * reach["true"])  # fits neither way
    assert r.lora.redraw_dropout is True and not verdict.fits
    # an explicit value is judged as it is; no dropout, or fp32 (peft's forward as it is): nothing to redraw
    for words, value in ((["lora.redraw_dropout=true"], True), (["lora.redraw_dropout=false"], False),
                         (["lora.dropout=0"], False), (["mixed_precision=no"], False)):
        r, _ = decide_dropout(load_recipe("single-gpu-lora", [*top, *words]), s, topo, gpu, None, seq_length=1024)
        assert r.lora.redraw_dropout is value, words

