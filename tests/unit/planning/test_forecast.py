"""planning/forecast.py: a step's time before launch, from the work counted and rates measured on recorded GPU rows."""

import importlib.util
import json
import sys

import pytest
from dataclasses import replace

from conftest import REPO
from memrecipe.planning import forecast as fc
from memrecipe.planning.activations import activation_mode, residual_bytes
from memrecipe.planning.architecture import read_config, structure
from memrecipe.planning.gpus import GPUS, gpu_for_device
from memrecipe.planning.hardware import cpu_flags
from memrecipe.planning.planner import Verdict, estimate, recommend
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology
from model_configs import LLAMA_8B

# benchmarks/forecast.py, the recorded GPU rows: loaded from its file (benchmarks/ on sys.path would shadow the
# tests' own `runs` package with benchmarks/runs.py)
_spec = importlib.util.spec_from_file_location("forecast_rows", REPO / "benchmarks" / "forecast.py")
rows = sys.modules["forecast_rows"] = importlib.util.module_from_spec(_spec)  # (its dataclasses look it up there)
_spec.loader.exec_module(rows)

PLAIN = ["gradient_checkpointing=false", "tiled_mlp=false", "fused_loss=false"]


def test_matmul_flops_count_each_pass_the_recipe_runs():
    s = structure(read_config(None))
    layers = s.layers * sum(lin.params for lin in s.linears)
    mlps = s.layers * sum(lin.params for lin in s.linears if lin.name in ("gate_proj", "up_proj", "down_proj"))
    head = s.vocab * s.hidden
    full, lora = (load_recipe(name, PLAIN) for name in ("single-gpu-full", "single-gpu-lora"))
    assert fc.matmul_flops(full, s) == 6 * (layers + head)  # forward, input gradients, weight gradients
    assert fc.matmul_flops(lora, s) == 4 * (layers + head)  # the frozen base: no weight gradients
    on = load_recipe("single-gpu-lora", [*PLAIN, "gradient_checkpointing=true"])
    assert fc.matmul_flops(on, s) - fc.matmul_flops(lora, s) == 2 * layers  # each layer's forward again
    selective = load_recipe("single-gpu-lora", [*PLAIN, "gradient_checkpointing=selective"])
    assert fc.matmul_flops(selective, s) == fc.matmul_flops(lora, s)  # it keeps the matmuls' outputs
    tiled = load_recipe("single-gpu-lora", [*PLAIN[1:], "gradient_checkpointing=true", "tiled_mlp=true"])
    # the tiles' recompute in backward takes the place of the MLP in the layer's recompute, which leaves it out
    assert fc.matmul_flops(tiled, s) == fc.matmul_flops(on, s)
    assert fc.matmul_flops(tiled, s, tiles_recomputed=True) - fc.matmul_flops(on, s) == 2 * mlps  # (recorded rows)
    for words in (["gradient_checkpointing=selective"], ["gradient_checkpointing=false"]):  # where a recompute runs it
        again = load_recipe("single-gpu-lora", [*PLAIN[1:], "gradient_checkpointing=true", "tiled_mlp=true", *words])
        plain = load_recipe("single-gpu-lora", [*PLAIN[1:], "gradient_checkpointing=true", *words])
        assert fc.matmul_flops(again, s) - fc.matmul_flops(plain, s) == 2 * mlps, words
    fused = load_recipe("single-gpu-lora", [*PLAIN, "fused_loss=true"])
    assert fc.matmul_flops(fused, s) - fc.matmul_flops(lora, s) == 2 * head  # the logits again in backward


def test_attention_grows_with_the_row_and_is_recomputed_under_full_checkpointing():
    s = structure(LLAMA_8B)
    plain, full = (load_recipe("single-gpu-lora", [f"gradient_checkpointing={c}"]) for c in ("false", "true"))
    assert fc.attention_flops(plain, s, 2048) == s.layers * 2 * 2048 * 4096 * 3.5  # forward 2, backward 5 (halves)
    assert fc.attention_flops(full, s, 4096) == 2 * fc.attention_flops(full, s, 2048)  # a token: linear in S
    assert fc.attention_flops(full, s, 2048) / fc.attention_flops(plain, s, 2048) == 4.5 / 3.5


@pytest.mark.parametrize("seq, share, pairs", [
    (128, 1.0, 4),  # queries in blocks of 32, each computing the row's one key block whole: the square
    (256, 1.0, 4),  # blocks of 64 from 192 tokens
    (512, 1.0, 8),
    (1024, 0.75, 6),  # blocks of 256 from 768; the first two reach one key block of 512, the last two both
    (2048, 0.625, 20),
    (4096, 0.5625, 72)])
def test_the_cpu_flash_kernel_computes_whole_key_blocks(seq, share, pairs):
    """torch's CPU flash kernel (sdpa on a CPU) computes every key block a query block reaches, whole, and masks
    the future keys rather than skipping them: at 512 tokens or fewer, the whole square; the causal half only as
    the row grows past its 512-key blocks (benchmarks/forecast.py --cpu prints each shape's causal time over its
    unmasked time beside this share: 0.61-0.66 at 2,048 tokens, 1.0 at 512 and below)."""
    assert fc.cpu_flash_work(seq) == (share, pairs)
    assert fc.cpu_flash_work(seq, causal=False)[0] == 1.0  # under a mask: every block


def test_cpu_attention_is_its_kernels_blocks_and_a_packed_rows_mask_computes_every_score():
    s = structure(read_config(None))
    words = ["gradient_checkpointing=false", "attn_implementation=sdpa"]
    whole, packed = (load_recipe("single-gpu-lora", [*words, f"packing={p}"]) for p in ("false", "true"))
    cpu, gpu = fc.CPU_RATES, fc.REFERENCE
    # a GPU's kernel skips the blocks above the diagonal; a mask (packed documents under sdpa) makes it compute all
    half = fc.attention_seconds(whole, s, 2048, 1, "sdpa", gpu)
    assert half == pytest.approx(fc.attention_flops(whole, s, 2048) * 2048 / gpu.attention["sdpa"])
    assert fc.attention_seconds(packed, s, 2048, 1, "sdpa", gpu) == pytest.approx(2 * half)
    flex = fc.attention_seconds(whole, s, 2048, 1, "flex_attention", gpu)
    assert fc.attention_seconds(packed, s, 2048, 1, "flex_attention", gpu) == flex  # (its block mask skips)
    # on a CPU, at 256 tokens the kernel computes the whole square, causal or masked, and pays each block and score
    share, blocks = fc.cpu_flash_work(256)
    scores = s.layers * s.heads * share * 256**2
    expected = (fc.attention_flops(whole, s, 256, share) * 256 / cpu.attention["sdpa"]
                + scores * cpu.attention_score + s.layers * s.heads * blocks * cpu.attention_block)
    assert fc.attention_seconds(whole, s, 256, 1, "sdpa", cpu) == pytest.approx(expected)
    assert fc.attention_seconds(packed, s, 256, 1, "sdpa", cpu) == pytest.approx(expected)
    assert expected > 2 * fc.attention_flops(whole, s, 256) * 256 / cpu.attention["sdpa"]  # more than half's FLOPs


def test_a_sliding_window_computes_its_band_or_under_sdpas_mask_the_whole_square():
    """A sliding-window layer (Mistral's, Gemma's) past its window: flash-attn and flex_attention compute the band
    (window_share, each query its window of keys: the count of visible scores), sdpa under the dense mask every
    score; a layer below its window, or without one, causal. Each group of layers at its own."""
    assert fc.window_share(2048, 0) == fc.window_share(2048, 4096) == 0.5
    for seq, window in ((8192, 4096), (32768, 4096), (4096, 1024)):
        visible = sum(min(i + 1, window) for i in range(seq))
        assert fc.window_share(seq, window) == pytest.approx(visible / seq**2, rel=1e-3)
    whole = load_recipe("single-gpu-lora", ["attn_implementation=sdpa", "packing=false"])
    gpu, llama = fc.REFERENCE, structure(LLAMA_8B)
    mistral = structure(LLAMA_8B | {"model_type": "mistral", "sliding_window": 4096})
    gemma = structure(LLAMA_8B | {"model_type": "gemma3_text", "sliding_window": 4096, "head_dim": 128})
    assert [(g.layers, g.window) for g in gemma.groups()] == [(27, 4096), (5, 0)]
    causal = {k: fc.attention_seconds(whole, llama, 32768, 1, k, gpu) for k in ("sdpa", "flex_attention")}
    assert fc.attention_seconds(whole, mistral, 32768, 1, "sdpa", gpu) == pytest.approx(2 * causal["sdpa"])
    assert fc.attention_seconds(whole, mistral, 2048, 1, "sdpa", gpu) == pytest.approx(
        fc.attention_seconds(whole, llama, 2048, 1, "sdpa", gpu))  # (below the window: causal)
    band = fc.window_share(32768, 4096) / 0.5
    assert fc.attention_seconds(whole, mistral, 32768, 1, "flex_attention", gpu) == pytest.approx(
        band * causal["flex_attention"])
    assert fc.attention_seconds(whole, gemma, 32768, 1, "flex_attention", gpu) == pytest.approx(
        (27 * band + 5) / 32 * causal["flex_attention"])


@pytest.mark.parametrize("seq, chunk, window", [(8192, 1024, 4096), (8192, 1024, 1000), (3000, 512, 700),
                                                 (4096, 4096, 1024)])
def test_query_chunks_compute_a_sliding_windows_band(seq, chunk, window):
    """Under query_chunks a sliding-window layer takes no mask (training.query_chunks.windowless_mask): each chunk
    of queries runs against the keys its window reaches (BandedAttention). On a GPU, flash's local attention: the
    band alone, as flash-attn's; on a CPU, torch's kernel under the band's additive mask computes every block of
    each call: the chunk's queries by the chunk + window - 1 keys (fewer at the start), in its blocks."""
    q = 256 if chunk >= 768 else 64 if chunk >= 192 else 32
    calls = [(min(chunk, seq - m), min(m + chunk, seq) - max(0, m - window + 1)) for m in range(0, seq, chunk)]
    assert fc.cpu_band_work(seq, chunk, window) == pytest.approx((
        sum(r * k for r, k in calls) / seq**2, sum(-(-r // q) * -(-k // 512) for r, k in calls)))
    mistral = structure(LLAMA_8B | {"model_type": "mistral", "sliding_window": window})
    llama = structure(LLAMA_8B)
    words = ["attn_implementation=sdpa", "packing=false", "per_device_train_batch_size=1",
             "gradient_checkpointing=false"]  # (one forward and one backward: attention_passes 3.5)
    whole, chunks = (load_recipe("single-gpu-lora", [*words, *extra]) for extra in ([], [f"query_chunks={chunk}"]))
    gpu, cpu = fc.REFERENCE, fc.CPU_RATES
    causal = fc.attention_seconds(chunks, llama, seq, 1, "sdpa", gpu)
    assert causal == fc.attention_seconds(whole, llama, seq, 1, "sdpa", gpu)  # (a row's causal half, chunked or not)
    assert fc.attention_seconds(chunks, mistral, seq, 1, "sdpa", gpu) == pytest.approx(
        fc.window_share(seq, window) / 0.5 * causal)
    banded = fc.attention_seconds(chunks, mistral, seq, 1, "sdpa", cpu)
    masked = fc.attention_seconds(whole, mistral, seq, 1, "sdpa", cpu)  # (the dense mask: the whole square)
    share, pairs = fc.cpu_band_work(seq, chunk, window)
    g = mistral.groups()[0]
    assert banded == pytest.approx(fc.attention_flops(chunks, g, seq, share) * seq / cpu.attention["sdpa"]
                                   + g.layers * g.heads * (share * seq**2 * cpu.attention_score
                                                           + pairs * cpu.attention_block))
    # (one chunk a row: the whole square under the band's mask, as under the dense one)
    assert banded < masked if chunk < seq else banded == pytest.approx(masked)


@pytest.mark.parametrize("seq, chunk", [(2048, 256), (1000, 300), (4096, 1024)])
def test_a_rows_query_chunks_on_a_cpu_pay_each_calls_blocks(seq, chunk):
    """On a CPU a row in query chunks (training.query_chunks.QueryChunkedAttention through CpuFlash) is many calls of
    torch's kernel, each in its own chunk's query blocks: forward, a chunk's causal square and the keys before it;
    backward, a call for each chunk of keys up to its own. At 2,048 tokens in chunks of 256: 96 pairs of blocks
    forward and 144 backward, where one call a row computes 20. The forecast pays a forward's blocks each forward
    pass and a backward's each backward (measured: 1.18x the forecast as one call a row, docs/speed.md)."""
    def blocks(n):  # a call's query blocks: by its own queries
        return -(-n // (256 if n >= 768 else 64 if n >= 192 else 32))

    starts = list(range(0, seq, chunk))
    rows = [min(chunk, seq - m) for m in starts]
    square = [fc.cpu_flash_work(n) for n in rows]  # (a chunk's own keys: a causal call of its length)
    scores = sum(share * n * n + n * m for (share, _), n, m in zip(square, rows, starts))
    forward = sum(pairs + blocks(n) * -(-m // 512) for (_, pairs), n, m in zip(square, rows, starts))
    backward = sum(pairs + m // chunk * blocks(n) * -(-chunk // 512) for (_, pairs), n, m in zip(square, rows, starts))
    assert fc.cpu_chunks_work(seq, chunk) == pytest.approx((scores / seq**2, forward, backward))
    assert fc.cpu_chunks_work(2048, 256)[1:] == (96, 144)
    llama = structure(LLAMA_8B)
    words = ["attn_implementation=sdpa", "packing=false", "per_device_train_batch_size=1",
             "gradient_checkpointing=false"]  # (one forward and one backward: attention_passes 3.5)
    whole, chunks = (load_recipe("single-gpu-lora", [*words, *extra]) for extra in ([], [f"query_chunks={chunk}"]))
    cpu = fc.CPU_RATES
    share, forward, backward = fc.cpu_chunks_work(seq, chunk)
    assert fc.attention_seconds(chunks, llama, seq, 1, "sdpa", cpu) == pytest.approx(
        fc.attention_flops(chunks, llama, seq, share) * seq / cpu.attention["sdpa"] + llama.layers * llama.heads * (
            share * seq**2 * cpu.attention_score + (forward + 2.5 * backward) / 3.5 * cpu.attention_block))
    chunked, one = (fc.attention_seconds(r, llama, seq, 1, "sdpa", cpu) for r in (chunks, whole))
    # more, smaller blocks than one call a row; chunks of 1,024 are whole blocks of the row's own (256 x 512)
    assert chunked > one if chunk < 768 else chunked == pytest.approx(one)


def test_a_cpu_pays_each_checkpointed_layers_recompute_beyond_its_pass():
    """torch.utils.checkpoint's own work (its hooks, autocast's casts of the weights again) in the recompute costs a
    CPU more than a pass of the layer's ops: measured apart (benchmarks/forecast.py --cpu), counted a layer."""
    s = structure(read_config(None))
    off, on = (load_recipe("single-gpu-full", [f"gradient_checkpointing={c}", "tiled_mlp=false"])
               for c in ("false", "true"))
    est = estimate(off, s, Topology(1, cpu=True))
    without, with_ = (fc.forecast(r, s, est, fc.CPU_RATES).parts["dispatch"] for r in (off, on))
    per_micro_batch = (with_ - without) / off.gradient_accumulation_steps
    assert per_micro_batch == pytest.approx(s.layers * (fc.CPU_RATES.layer_dispatch + fc.CPU_RATES.recompute_dispatch))
    assert fc.CPU_RATES.recompute_dispatch > 0


def test_a_cpu_pays_each_rungs_own_ops_and_the_tiled_mlps_tiles():
    """Beyond full checkpointing a CPU spends on each rung's own ops (measured apart, benchmarks/forecast.py --cpu):
    the lean norms' functions a layer, and the tiled MLP's ops once a tile, with its adapters'; one tile is the plain
    MLP (training.tiling.tiled_forward), which costs nothing more."""
    s = structure(read_config(None))  # hidden 128: tiled_mlp=true cuts 256 tokens into 2 tiles, 128 into 1
    rates = fc.CPU_RATES
    lean = load_recipe("single-gpu-lora", ["lean_norms=true", "tiled_mlp=false"])
    assert fc.rung_seconds(lean, s, 256, rates) == rates.rung_dispatch["lean_norms"] > 0
    tiled = load_recipe("single-gpu-lora", ["tiled_mlp=true", "lora.target_modules=all-linear"])
    assert fc.rung_seconds(tiled, s, 128, rates) == 0
    assert fc.rung_seconds(tiled, s, 256, rates) == pytest.approx(2 * (rates.tile_dispatch
                                                                        + 3 * rates.tile_adapter_dispatch))
    assert fc.rung_seconds(tiled, s, 256, fc.REFERENCE) == 0  # (a GPU's: in its efficiencies)


def test_each_efficiency_is_what_its_row_measured():
    """The constants are derived from their rows (benchmarks/forecast.py --derive), not set by hand: one changed
    without its row fails here."""
    saved = (fc.MATMUL, dict(fc.ATTENTION), fc.ADAPTERS, fc.DEQUANTIZE, fc.CPU_ADAM)
    try:
        derived = rows.derive()
    finally:
        fc.MATMUL, fc.ATTENTION, fc.ADAPTERS, fc.DEQUANTIZE, fc.CPU_ADAM = saved
    assert derived["ATTENTION sdpa"] == pytest.approx(fc.ATTENTION["sdpa"], rel=0.01)
    assert derived["ATTENTION flex_attention"] == pytest.approx(fc.ATTENTION["flex_attention"], rel=0.01)
    for name in ("MATMUL", "ADAPTERS", "DEQUANTIZE", "CPU_ADAM"):
        assert derived[name] == pytest.approx(getattr(fc, name), rel=0.01), name


def test_the_recorded_gpu_rows_are_forecast_within_30_percent_but_three():
    """Every row of a recorded GPU run timed after its first step, forecast against measured: within +-30% (the
    issue's goal) except three (docs/speed.md): the 1B's 16K-token top-rung row of the second lease (1.34x: that
    lease's offload copied to pageable memory, and no GPU row has priced the top rung's lean norms and tiled MLP yet),
    the fifth lease's LoRA row on the H200 (1.46x: a launch-bound step on a slower host; the forecast has no host
    term) and its long row slowed by the allocator's recorded history (1.38x)."""
    ratios = {row.name: rows.real(row, rows.forecast_row(row)) / row.measured for row in rows.ROWS if row.warm}
    assert len(ratios) == 13
    assert [name for name, r in ratios.items() if not 0.7 <= r <= 1.3] == [
        "long context 16K", "single-gpu-lora (H200)", "long-8b flex 128K, history recorded"], ratios
    checks = [row.name for row in rows.ROWS if row.warm and row.role == "check"]
    assert {"single-gpu-lora, sdpa", "qlora, activation_offload"} <= set(checks)  # rows no constant was taken from


def test_trls_million_token_step_is_forecast_within_half_to_twice():
    """A check from outside, no constant taken from it: TRL's 1M-token example, 380 s a step on 8 H100s."""
    assert 0.5 <= rows.TRL_1M[1] / rows.trl_1m().step_seconds <= 2


def test_a_named_gpu_forecasts_at_its_own_rates():
    s = structure(LLAMA_8B)
    recipe = load_recipe("single-gpu-lora", ["max_seq_length=4096"])
    h100, a10g = (estimate(recipe, s, Topology(1), rates=fc.gpu_rates(GPUS[name])) for name in ("H100", "A10G"))
    assert h100.forecast_on == "H100" and a10g.forecast_on == "A10G"
    assert h100.step_seconds < a10g.step_seconds and h100.tokens_per_second == pytest.approx(
        4 * 4 * 4096 / h100.step_seconds)  # micro batch 4 x accumulation 4 x 4096 tokens a step
    assert estimate(recipe, s, Topology(1)).forecast_on == "H100"  # the reference when none is named
    assert estimate(recipe, s, Topology(1, cpu=True)).forecast_on == fc.cpu_rates(cpu_flags()).name  # (this CPU's)


def test_a_plan_on_a_cpu_forecasts_at_the_rates_of_its_kind(tmp_path, monkeypatch):
    """`plan --cpu` (and a smoke run's report) forecasts at the rates measured on a CPU of this one's kind: on an AMX
    CPU torch's bf16 GEMMs are oneDNN's on its tiles, five times an AVX2 CPU's, and at the AVX2 machine's rates its
    smoke run read 1.2-2.0x its forecast (docs/speed.md)."""
    from memrecipe.planning import planner

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16 amx_tile\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "amx_bf16", "amx_tile"} and cpu_flags(str(tmp_path)) == set()
    assert fc.cpu_rates(cpu_flags(str(info))) is fc.AMX_RATES
    assert fc.cpu_rates(frozenset({"avx2", "avx512f"})) is fc.cpu_rates(frozenset()) is fc.CPU_RATES
    assert fc.AMX_RATES.matmul > 4 * fc.CPU_RATES.matmul
    s, recipe = structure(read_config(None)), load_recipe("single-gpu-lora", [])
    plans = {}
    for flags in ("fpu avx2 amx_bf16", "fpu avx2"):
        monkeypatch.setattr(planner, "cpu_flags", lambda flags=flags: frozenset(flags.split()))
        plans[flags] = estimate(recipe, s, Topology(1, cpu=True))
    amx, avx2 = plans.values()
    assert (amx.forecast_on, avx2.forecast_on) == (fc.AMX_RATES.name, fc.CPU_RATES.name)
    assert amx.tokens_per_second > avx2.tokens_per_second


@pytest.mark.parametrize("words", [["gradient_checkpointing=true"], ["gradient_checkpointing=false"],
                                   ["gradient_checkpointing=selective"],  # (it recomputes all but the matmuls)
                                   ["gradient_checkpointing=true", "lora.redraw_dropout=false"],
                                   ["gradient_checkpointing=true", "tiled_mlp=2"]])
def test_loras_dropout_draws_are_what_a_real_step_draws(words):
    """forecast.dropout_draws is what the dropouts of a real bf16 step draw, counted op by op (bernoulli_'s
    elements; a layer's: one layer against two, a token's: 64 tokens against 128): the adapter's own checkpoint
    redraws once in backward, beside the forward and the layer's recompute, not once for each of them."""
    import torch

    from helpers import loop_model
    from measuring import _step, dropout_draws_made
    from memrecipe.training.loading import embedded_model

    lora = ["lora.target_modules=all-linear", "lora.dropout=0.1"]
    made = {}
    for length in (64, 128):
        recipe = load_recipe("single-gpu-lora", [*words, *lora, f"max_seq_length={length}", "packing=false",
                                                 "attn_implementation=sdpa"])
        ids = torch.randint(0, 500, (1, length), generator=torch.Generator().manual_seed(0))
        b = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids),
             "position_ids": torch.arange(length)[None]}
        for layers in (1, 2):
            m, _ = loop_model(recipe, embedded_model(), "bf16")
            m.train()
            m.base_model.model.model.layers = m.base_model.model.model.layers[:layers]
            made[length, layers] = dropout_draws_made(lambda: _step(m, b, True))  # noqa: B023
    measured = (made[128, 2] - made[128, 1] - made[64, 2] + made[64, 1]) / 64
    s = structure(read_config(None))
    assert fc.dropout_draws(load_recipe("single-gpu-lora", [*words, *lora]), s) / s.layers == measured


@pytest.mark.parametrize("recipe, words, draws", [
    ("single-gpu-lora", ["gradient_checkpointing=true"], 3),  # forward, recompute, the redraw in backward
    ("single-gpu-lora", ["gradient_checkpointing=false"], 2),
    ("single-gpu-lora", ["gradient_checkpointing=true", "lora.redraw_dropout=false"], 2),  # peft's masks kept
    ("zero3-offload", ["lora.r=16", "gradient_checkpointing=true"], 3),  # DeepSpeed's bf16 adapters redraw too
    ("zero3-offload", ["lora.r=16", "gradient_checkpointing=true", "lora.redraw_dropout=false"], 2),
    ("single-gpu-lora", ["lora.dropout=0"], 0)])
def test_loras_dropout_is_a_cost_of_its_own_where_drawing_is(recipe, words, draws):
    """A CPU draws dropout's random numbers slowly (the embedded single-gpu-lora step's bernoulli: a third of it): its
    rates count the elements drawn apart from the adapters' bytes, each adapter's input width a draw (forward, the
    recompute, the redraw in backward). A GPU's fused dropout stays in the adapters' bytes."""
    s = structure(read_config(None))
    r = load_recipe(recipe, ["lora.target_modules=all-linear", "tiled_mlp=false", *words])
    widths = s.layers * sum(lin.in_features for lin in s.lora_linears(r.lora.target_modules))
    assert fc.dropout_draws(r, s) == draws * widths
    est = estimate(r, s, Topology(1, cpu=True))
    cpu, gpu = fc.forecast(r, s, est, fc.CPU_RATES), fc.forecast(r, s, est, fc.REFERENCE)
    assert "dropout" not in gpu.parts
    if draws:
        assert cpu.parts["dropout"] == pytest.approx(r.gradient_accumulation_steps * draws * widths * est.micro_batch
                                                     * est.seq_length / fc.CPU_RATES.dropout)
        undropped = fc.adapter_bytes(load_recipe(recipe, ["lora.target_modules=all-linear", "tiled_mlp=false",
                                                          *words, "lora.dropout=0"]), s)
        assert cpu.parts["adapters"] == pytest.approx(r.gradient_accumulation_steps * undropped * est.micro_batch
                                                      * est.seq_length / fc.CPU_RATES.adapters)


def test_the_recommendation_is_the_fastest_forecast_that_fits():
    s = structure(LLAMA_8B)
    slow, fast = (estimate(load_recipe("single-gpu-lora", [f"gradient_checkpointing={c}", "max_seq_length=1024"]), s,
                           Topology(1)) for c in ("true", "false"))
    assert fast.tokens_per_second > slow.tokens_per_second
    best, why = recommend([Verdict(slow, 2**40, None), Verdict(fast, 2**40, None)])
    assert best.estimate is fast and f"{fast.tokens_per_second:,.0f} tokens/s forecast on H100" in why
    best, _ = recommend([Verdict(slow, 2**40, None), Verdict(fast, fast.total - 1, None)])  # the fast one does not fit
    assert best.estimate is slow


def test_a_cuda_device_name_finds_its_gpu():
    report = json.loads((REPO / "benchmarks" / "gpu_results" / "2026-11-27-h100" / "adamw-8bit-resumed.report.json")
                        .read_text())
    assert gpu_for_device(report["device"]) is GPUS["H100"]
    assert gpu_for_device("NVIDIA H200") is GPUS["H200"] and gpu_for_device("NVIDIA A100-SXM4-40GB") is GPUS["A100-40GB"]
    assert gpu_for_device("NVIDIA H100 PCIe") is GPUS["H100-PCIe"] and gpu_for_device("Tesla T4") is None


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Qwen3 at the embedded model's widths: RMSNorms of the query and key heads beside Llama's two."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

    from memrecipe.training.loading import embedded_model

    llama = AutoConfig.from_pretrained(embedded_model())
    widths = {k: getattr(llama, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads", "head_dim")}
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("qwen3")
    AutoModelForCausalLM.from_config(Qwen3Config(**widths, pad_token_id=None, eos_token_id=None,
                                                 bos_token_id=None)).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("model, words, lora", [
    ("embedded", ["gradient_checkpointing=false"], False),  # a 16-bit stream, the norms trained
    ("embedded", ["gradient_checkpointing=true"], False),  # the forward again
    ("embedded", ["gradient_checkpointing=selective"], False),  # the same ops again (it keeps the matmuls' outputs)
    ("embedded", ["gradient_checkpointing=true", "weight_dtype=fp32"], False),  # an fp32 stream: autocast's casts
    ("embedded", ["gradient_checkpointing=true"], True),  # the norms frozen, as under LoRA
    ("embedded", ["gradient_checkpointing=true", "lean_norms=true"], False),  # training.norms' own ops
    ("embedded", ["gradient_checkpointing=true", "lean_norms=true"], True),
    ("qwen3", ["gradient_checkpointing=false"], False)])  # the query's and key's norms
def test_the_elementwise_bytes_are_what_a_layers_ops_move(model, words, lora, qwen3):
    """What forecast.elementwise_bytes counts a layer a token is what its ops read and write beside the matmuls and
    attention, counted op by op under a dispatch mode through a real step in bf16 (a layer's: one layer against two;
    a token's: 64 tokens against 128). LoRA's adapters move bytes of their own (forecast.adapter_bytes): the LoRA
    case is the base model's layers with their norms frozen, as LoRA leaves them."""
    import torch

    from helpers import loop_model
    from measuring import _step, elementwise_bytes_moved
    from memrecipe.training.loading import embedded_model

    path = qwen3 if model == "qwen3" else embedded_model()
    moved = {}
    for length in (64, 128):
        recipe = load_recipe("single-gpu-full", [*words, *PLAIN[1:], f"max_seq_length={length}", "packing=false",
                                                 "attn_implementation=sdpa"])
        ids = torch.randint(0, 500, (1, length), generator=torch.Generator().manual_seed(0))
        b = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids),
             "position_ids": torch.arange(length)[None]}
        for layers in (1, 2):
            m, _ = loop_model(recipe, path, "bf16")
            m.train()
            m.model.layers = m.model.layers[:layers]
            for name, p in m.named_parameters():
                p.requires_grad_(not (lora and "norm" in name))
            moved[length, layers] = elementwise_bytes_moved(lambda: _step(m, b, True))  # noqa: B023
    measured = (moved[128, 2] - moved[128, 1] - moved[64, 2] + moved[64, 1]) / 64
    s = structure(read_config(path))
    planned = load_recipe("single-gpu-lora" if lora else "single-gpu-full", [*words, *PLAIN[1:]])
    stream = residual_bytes(activation_mode(planned, 2))
    per_layer = (fc.elementwise_bytes(planned, s, stream) - fc.elementwise_bytes(planned, replace(s, layers=0), stream)) \
        / s.layers
    assert per_layer == pytest.approx(measured, rel=0.03)


def test_a_cpu_pays_the_elementwise_bytes_where_a_gpu_keeps_them_in_its_efficiency():
    """On a CPU the layers' elementwise ops are a term of their own, their bytes at the elementwise rate (measured
    apart: benchmarks/forecast.py --cpu); a GPU's forecast keeps them inside MATMUL's measured efficiency."""
    s = structure(read_config(None))
    recipe = load_recipe("single-gpu-full", ["gradient_checkpointing=true"])
    est = estimate(recipe, s, Topology(1, cpu=True))
    cpu, gpu = (fc.forecast(recipe, s, est, rates) for rates in (fc.CPU_RATES, fc.REFERENCE))
    tokens = est.micro_batch * est.seq_length * recipe.gradient_accumulation_steps
    assert cpu.parts["elementwise"] == pytest.approx(fc.elementwise_bytes(recipe, s, est.stream_bytes) * tokens
                                                      / fc.CPU_RATES.elementwise)
    assert "elementwise" not in gpu.parts


def test_run_dpos_reference_is_one_more_forward_a_micro_batch(tmp_path):
    """Where run dpo's reference runs beside each micro batch (a frozen copy of the model, a saved adapter's frozen
    copy, or LoRA's base with the adapters off), a step pays one forward more per micro batch and nothing else: its
    matmuls' third (forward, input and weight gradients), attention's forward of its 3.5, the loss's forward bytes; a
    saved adapter's copy its adapters' forward; on a CPU one pass's dispatch too. A store computed before step 1, or a
    reference-free loss, costs a step nothing. plan's command for such a plan is run dpo (run sft refuses a dpo:
    section)."""
    from click.testing import CliRunner

    from memrecipe.main import cli

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    s = structure(read_config(str(tmp_path)))
    topo = Topology(1)

    def step(name, *words, rates=fc.REFERENCE):
        recipe = load_recipe(name, [*PLAIN, "attn_implementation=sdpa", "packing=false", *words])
        return fc.forecast(recipe, s, estimate(recipe, s, topo, rates=rates), rates)

    sft, copy = step("single-gpu-full"), step("single-gpu-full", "dpo.precompute_ref_log_probs=false")
    assert copy.parts.keys() - sft.parts.keys() == {"reference"}
    assert {k: v for k, v in copy.parts.items() if k != "reference"} == pytest.approx(sft.parts)
    accumulation = load_recipe("single-gpu-full").gradient_accumulation_steps
    forward = sft.parts["matmuls"] / 3 + sft.parts["attention"] / 3.5 \
        + sft.parts["loss"] * fc.LOSS_FORWARD_BYTES / fc.LOSS_BYTES
    assert copy.parts["reference"] == pytest.approx(forward)
    assert copy.step_seconds == pytest.approx(sft.step_seconds + accumulation * forward)
    for free in (step("single-gpu-full", "dpo.beta=0.1"), step("single-gpu-lora", "dpo.loss_type=simpo")):
        assert "reference" not in free.parts  # (a store; simpo: no reference)
    adapter = tmp_path / "adapter"  # (a saved adapter of the recipe's shape: r 16 on every linear)
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 32,
                                                             "target_modules": "all-linear"}))
    lora = step("single-gpu-lora", "lora.dropout=0")
    off, saved = step("single-gpu-lora", "lora.dropout=0", "dpo.beta=0.1"), step(
        "single-gpu-lora", "lora.dropout=0", "dpo.beta=0.1", f"lora.adapter={adapter}")
    # the frozen base's matmuls: forward 2 of LoRA's 4 (input gradients, no weight gradients)
    base = lora.parts["matmuls"] / 2 + lora.parts["attention"] / 3.5 + lora.parts["loss"] * 12 / fc.LOSS_BYTES
    assert off.parts["reference"] == pytest.approx(base)
    assert saved.parts["reference"] == pytest.approx(base + lora.parts["adapters"] / 3)  # (a forward of 3 passes)
    # a pass more over the weights: QLoRA dequantizes them for it (forward, recompute, backward, and the reference's)
    qlora, qlora_dpo = step("qlora", "gradient_checkpointing=true"), step("qlora", "gradient_checkpointing=true",
                                                                          "dpo.beta=0.1")
    assert qlora_dpo.parts["dequantize"] == pytest.approx(qlora.parts["dequantize"] * 4 / 3)
    cpu_lora, cpu_off = step("single-gpu-lora", rates=fc.CPU_RATES), step("single-gpu-lora", "dpo.beta=0.1",
                                                                          rates=fc.CPU_RATES)
    assert cpu_off.parts["reference"] > (cpu_lora.parts["matmuls"] / 2 + s.layers * fc.CPU_RATES.layer_dispatch)
    said = CliRunner().invoke(cli, ["plan", "--recipe", "single-gpu-lora", "--cpu", "dpo.beta=0.1"])
    assert said.exit_code == 0 and "memrecipe run dpo --recipe single-gpu-lora dpo.beta=0.1" in said.output
