"""The fused loss: the same loss, gradients and eval loss as the full logits, on 1 process (here) and
on DDP, FSDP2 and ZeRO-3 (launched workers); a measured fraction of the memory; the planner's logits
figure equal to what the loss step really allocates, for both paths."""

import copy
import json
import subprocess
import sys

import pytest
import torch

from helpers import REPO, SideBySide, child_env, free_port, loop_model, tiny_model, uneven_examples
from memrecipe.planning.architecture import structure
from memrecipe.planning.activations import activation_bytes, activation_mode
from memrecipe.planning.registry import load_recipe
from memrecipe.training.data import Collator
from memrecipe.training.loss import count_targets, fuse_head, lm_loss, output_head, token_loss
from memrecipe.training.probes import LossMemory


def batch():
    return Collator(0)(uneven_examples(8))  # prompts masked, padding, very different lengths


def head_outputs(model) -> list:
    """The shapes the output head returns, call by call: [targets] when fused (one loss per target token, never
    the logits), [rows, tokens, vocab] when not."""
    shapes = []
    output_head(model).register_forward_hook(lambda m, args, out: shapes.append(tuple(out.shape)))
    return shapes


def loss_grads_eval(model, fused, chunk_tokens=5):
    """Loss and gradients (fp32) of one batch, and per-sequence eval losses; the head fused in 5-token chunks.
    A fused run also proves that the fused head ran: it returned one loss per target token, twice."""
    model = copy.deepcopy(model)
    if fused:
        assert fuse_head(model, chunk_tokens) is None
    b, shapes = batch(), head_outputs(model)
    if fused:
        loss = lm_loss(model, b)
    else:  # the full logits, as before the fused loss existed
        loss = token_loss(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
    loss.backward()
    with torch.no_grad():
        per_sequence = lm_loss(model, b, per_sequence=True)
    if fused:
        assert shapes == [(count_targets(b),)] * 2, shapes
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads, per_sequence


def assert_same(model):
    plain_loss, plain, plain_eval = loss_grads_eval(model, fused=False)
    fused_loss, fused, fused_eval = loss_grads_eval(model, fused=True)
    assert fused_loss == pytest.approx(plain_loss, abs=1e-5 * abs(plain_loss))
    assert plain.keys() == fused.keys() and any(g.abs().sum() > 0 for g in plain.values())
    for name in plain:
        assert torch.allclose(fused[name], plain[name], atol=1e-5, rtol=0), name
    assert torch.allclose(fused_eval, plain_eval, atol=1e-5, rtol=0)
    assert fused_eval.sum().item() == pytest.approx(plain_loss, rel=1e-6)


def test_fused_equals_plain_for_a_full_fine_tune():
    assert_same(tiny_model())


def test_the_fused_heads_backward_never_waits_for_the_device():
    """No op in the head's backward reads a value back to the host (nonzero, a boolean index, item): on a GPU each
    would stall the stream twice a tile (~256 times an 8B micro batch of 2 x 2048). Same gradients: the test above."""
    from measuring import ops_counted

    model = copy.deepcopy(tiny_model())
    fuse_head(model, 5)
    loss = lm_loss(model, batch())
    names = set()
    ops_counted(loss.backward, lambda func, *_: names.add(func.overloadpacket.__name__) or 0)
    assert "mm" in names and not names & {"nonzero", "index", "index_put_", "_local_scalar_dense",
                                          "masked_select"}, sorted(names)


def test_fused_equals_plain_with_tied_embeddings():
    model = tiny_model()
    model.lm_head.weight = model.model.embed_tokens.weight
    assert_same(model)


def test_fused_equals_plain_with_lora_on_the_head_too():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                    target_modules=["q_proj", "v_proj", "lm_head"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero: give the adapters something to carry
            torch.nn.init.normal_(p, std=0.1)
    assert_same(model)
    fuse_head(model)  # the LoRA-wrapped head is marked for ZeRO-3 to gather whole
    assert hasattr(output_head(model), "lora_A") and output_head(model)._z3_leaf


def test_a_bf16_heads_gradient_is_summed_over_the_chunks_in_fp32():
    """128 chunks of 4 tokens into a bf16 head: the weight's gradient is as close to fp32's as one bf16 rounding
    allows. Summed in bf16 (what autograd does with the chunks' gradients), it drifts several times further."""
    from memrecipe.training.loss import HeadLoss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(512, 32, generator=g).bfloat16()
    weight = (torch.randn(256, 32, generator=g) / 8).bfloat16()
    targets = torch.randint(0, 256, (512,), generator=g)

    def head_grad(dtype, tokens):
        w = weight.to(dtype, copy=True).requires_grad_(True)
        HeadLoss.apply(hidden.to(dtype), targets, tokens, w, None).mean().backward()
        return w.grad.float()

    exact = head_grad(torch.float64, 512)
    fused = head_grad(torch.bfloat16, 4)
    in_bf16 = torch.zeros_like(weight)  # the chunks' own bf16 gradients, summed in bf16
    for start in range(0, 512, 4):
        w = weight.clone().requires_grad_(True)
        HeadLoss.apply(hidden[start:start + 4], targets[start:start + 4], 4, w, None).sum().div(512).backward()
        in_bf16 += w.grad

    def error(grad):
        return ((grad.double() - exact).norm() / exact.norm()).item()

    assert fused.dtype == torch.float32 and error(fused) < 0.005, error(fused)  # ~ one bf16 rounding (2^-9)
    assert error(in_bf16) > 3 * error(fused), (error(in_bf16), error(fused))


def test_a_frozen_heads_backward_takes_the_whole_vocabulary_a_chunk_where_the_forwards_chunk_holds_it(monkeypatch):
    """On a GPU, LoRA's frozen head has no gradient sum to bound: HeadLoss's backward computes each chunk's whole
    logits at once (one tile a chunk, 2 matmuls: the logits and the input's gradient), where a trained head walks
    blocks of rows (and so does a CPU: the GPU's rule is run here as the CUDA device chooses it). The input's gradient
    is the plain cross-entropy's, both ways. The tile's bytes stay within the forward chunk's (the plan's figure): 6
    bytes a logit beside the input's fp32 gradient, <= 8 a logit; past that (long context) blocks."""
    from measuring import ops_counted
    from memrecipe.training import loss
    from memrecipe.training.loss import HeadLoss, tile_rows

    monkeypatch.setattr(loss, "tile_rows", lambda *args, **kwargs: tile_rows(*args, **{**kwargs, "cuda": True}))

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(96, 16, generator=g, dtype=torch.float64), torch.randn(512, 16, generator=g) / 4
    targets = torch.randint(0, 512, (96,), generator=g)
    plain = hidden.clone().requires_grad_(True)
    torch.nn.functional.cross_entropy(plain @ weight.double().t(), targets, reduction="sum").backward()
    for trained in (False, True):
        x, w = hidden.clone().requires_grad_(True), weight.double().requires_grad_(trained)
        loss = HeadLoss.apply(x, targets, 32, w, None).sum()
        matmuls = ops_counted(loss.backward, lambda func, *_: func.overloadpacket.__name__ in ("mm", "addmm"))
        assert torch.allclose(x.grad, plain.grad, atol=1e-6, rtol=0), trained  # (summed in fp32)
        blocks = -(-512 // tile_rows(32, 96, 512, 16, trained, cuda=True))
        assert matmuls == 3 * 2 * blocks + (3 * blocks if trained else 0), (trained, matmuls)
        assert (blocks == 1) is not trained
    # the rule: the tile and the input's gradient within the forward chunk's 8 bytes a logit, else blocks
    for targets, chunk, vocab, width in ((8192, 512, 128256, 2048), (700_000, 512, 128256, 4096), (100, 512, 32000, 64)):
        rows = tile_rows(chunk, targets, vocab, width, trained=False, cuda=True)
        within = 6 * min(chunk, targets) * vocab + 4 * targets * width <= 8 * min(chunk, targets) * vocab
        assert (rows == vocab) is within and rows == (vocab if within else chunk * vocab // (4 * width))
        assert tile_rows(chunk, targets, vocab, width, trained=False, cuda=False) == chunk * vocab // (4 * width)


def test_the_loops_setup_fuses_the_head_with_the_recipes_chunk(monkeypatch):
    """recipes/sft.py's setup_model reads loss_chunk_tokens: a micro batch then runs in chunks of that many tokens."""
    from memrecipe.training import loss as fused_loss
    from memrecipe.training.loading import embedded_model

    model, _ = loop_model(load_recipe("single-gpu-lora", ["loss_chunk_tokens=7"]), embedded_model(), "no")
    sizes, chunk_logits = [], fused_loss._chunk_logits
    monkeypatch.setattr(fused_loss, "_chunk_logits", lambda *args: sizes.append(len(args[1])) or chunk_logits(*args))
    b = batch()
    lm_loss(model, b).backward()
    assert max(sizes) == 7 and sum(sizes) % count_targets(b) == 0


def test_prompt_and_padding_positions_never_reach_the_head():
    model = tiny_model()
    fuse_head(model)
    b, rows = batch(), []
    output_head(model).register_forward_hook(lambda m, args, out: rows.append(len(out)))
    lm_loss(model, b)
    assert rows == [count_targets(b)] and rows[0] < b["labels"].numel() // 2


def test_a_batch_without_targets_still_reaches_every_weight():
    model = tiny_model()
    fuse_head(model)
    b, shapes = batch(), head_outputs(model)
    b["labels"][:] = -100
    loss = lm_loss(model, b)
    loss.backward()
    assert shapes == [(0,)]  # the fused head ran, on no target
    assert loss.item() == 0 and model.lm_head.weight.grad is not None
    assert all(p.grad is not None for p in model.parameters())


def test_a_multimodal_configs_text_part_is_read_for_logit_transforms():
    from types import SimpleNamespace

    from transformers import Gemma3Config

    from memrecipe.training.loss import fused_blocker

    config = Gemma3Config(text_config={"final_logit_softcapping": 30.0})
    assert "final_logit_softcapping" in fused_blocker(config)
    assert fused_blocker(SimpleNamespace(model_type="llama")) is None


def test_models_that_transform_their_logits_keep_the_plain_loss():
    model = tiny_model()
    model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in fuse_head(model)
    assert not hasattr(output_head(model), "memrecipe_targets")


def test_tensor_parallelism_refuses_the_fused_loss_with_the_reason():
    from memrecipe.errors import RecipeError

    with pytest.raises(RecipeError, match="fused_loss=false"):
        load_recipe("tp", ["fused_loss=true"])


# --- memory: measured on a model whose vocabulary dominates --------------------------------------

BIG_VOCAB = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 256, "intermediate_size": 512,
             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 1024, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def big_vocab_model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**BIG_VOCAB))


def loss_step_bytes(model, recipe, b):
    """What the loss step allocates at its peak (LossMemory, the report card's measurement)."""
    model = copy.deepcopy(model)
    if recipe.lora is not None:  # a frozen bf16 base, as the loop's setup stores it
        model = model.to(torch.bfloat16).requires_grad_(False)
        model.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)  # something before the head trains
    if recipe.fused_loss:
        fuse_head(model, recipe.loss_chunk_tokens)
    memory = LossMemory(model, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.mixed_precision != "no"):
        loss = lm_loss(model, b)
    loss.backward()
    return memory.bytes


@pytest.mark.slow
@pytest.mark.parametrize("recipe, overrides", [("single-gpu-lora", []), ("adamw-8bit", []),
                                               ("adamw-8bit", ["mixed_precision=no"])])
def test_fused_loss_holds_a_fraction_and_the_planner_counts_both(big_vocab_model, monkeypatch, recipe, overrides):
    from memrecipe.training import loss as fused_loss

    chunks, chunk_logits = [], fused_loss._chunk_logits  # each chunk's logits, forward and recompute
    monkeypatch.setattr(fused_loss, "_chunk_logits", lambda *args: chunks.append(len(args[1])) or chunk_logits(*args))
    B, S = 2, 1024
    ids = torch.randint(0, BIG_VOCAB["vocab_size"], (B, S), generator=torch.Generator().manual_seed(0))
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    measured, planned = {}, {}
    for fused in (False, True):
        r = load_recipe(recipe, [*overrides, f"fused_loss={str(fused).lower()}", f"per_device_train_batch_size={B}",
                                 f"max_seq_length={S}", "loss_chunk_tokens=256"])
        chunks.clear()
        measured[fused] = loss_step_bytes(big_vocab_model, r, b)
        # the chunks bound the loss: none larger than the knob, every target computed in forward and again in backward
        assert max(chunks, default=0) <= r.loss_chunk_tokens and sum(chunks) % (B * (S - 1)) == 0
        assert (sum(chunks) >= 2 * B * (S - 1)) is fused
        mode = activation_mode(r, 4 if r.mixed_precision == "no" else 2)
        planned[fused] = activation_bytes(r, structure(BIG_VOCAB), mode, B, S)["logits"]
    assert measured[True] * 4 <= measured[False], measured
    for fused in (False, True):
        assert planned[fused] == pytest.approx(measured[fused], rel=0.1), (fused, planned, measured)


# mode -> the worker's words: a head whose weights outweigh a chunk's logits (hidden 1024, 64-token chunks, as
# Llama-3.1-8B's head does at 512 tokens); a frozen head (lora) takes blocks of rows in backward on CPU, and as a GPU
# chooses (--cuda-tiles) one tile a chunk at 2 x 256 tokens, blocks at 2 x 1024 (its input's gradient outgrows a
# chunk's logits: training.loss.tile_rows)
HEAD_CASES = {"lora": ["lora", "1024", "64"], "lora, CUDA's tiles": ["lora", "1024", "64", "--cuda-tiles"],
              "lora, long, CUDA's tiles": ["lora", "1024", "64", "32000", "2", "1024", "--cuda-tiles"],
              "mixed": ["mixed", "1024", "64"], "half": ["half", "1024", "64"], "fp32": ["fp32", "1024", "64"]}


@pytest.fixture(scope="module")
def head_bytes():
    """tests/workers/head_loss_bytes.py for each case, a fresh process each, two at a time (bytes, not time)."""
    jobs = SideBySide({case: lambda core, words=words: subprocess.run(
        [sys.executable, str(REPO / "tests" / "workers" / "head_loss_bytes.py"), *words],
        capture_output=True, text=True, env=child_env(), timeout=120) for case, words in HEAD_CASES.items()})
    yield jobs
    jobs.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", HEAD_CASES)
def test_the_plan_counts_what_a_trained_heads_chunks_hold(head_bytes, mode):
    """Backward's blocks of rows (a trained head's gradient written out, each block's fp32 sum; a frozen head's one
    tile a chunk where it fits within the forward's chunk, blocks past it) and forward's chunks with the autocast copy,
    measured in a fresh process each and planned, within 3%. (Summed whole in fp32 and cast, as a first version did,
    the head's gradient held 3 to 6 bytes x the head more; a frozen head's whole-vocabulary tile at 2 x 1024 tokens,
    past the rule, held 1.21x the plan.)"""
    done = head_bytes(mode)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["planned"] == pytest.approx(r["measured"], rel=0.03), r


# --- the engines: one launch each, both losses in it ---------------------------------------------

ENGINES = [
    ("ddp", [], "tied,lora-head"),  # and, in the same launch, a head tied to the embeddings, and LoRA on the head
    ("fsdp", [], ""),  # FSDP2, full fine-tune: the head's weights are a sharded unit of its own
    ("fsdp-lora", ["lora.target_modules=[q_proj,v_proj,lm_head]", "lora.dropout=0"], ""),  # LoRA on the sharded head
    ("zero2", [], ""),  # partitioned gradients and optimizer state, whole weights
    ("zero3-offload", [], ""),  # partitioned weights, gathered by the engine's own hooks
    ("zero3-offload", ["lora.r=8", "lora.target_modules=[q_proj,v_proj,lm_head]", "lora.dropout=0"], ""),  # a ZeRO-3 leaf
]


IDS = ["ddp+tied+lora-head", "fsdp2", "fsdp2-lora-head", "zero2", "zero3", "zero3-lora-head"]


def fused_vs_plain(folder, recipe, overrides, variants):
    """One launch of tests/workers/fused_vs_plain.py on 2 processes: both losses, each variant; its results."""
    words = [*overrides, "mixed_precision=no", "gradient_accumulation_steps=1"]
    config = subprocess.run([sys.executable, "-m", "memrecipe", "config", recipe, "--cpu", "--num-processes", "2",
                             "--output-dir", str(folder), *words], capture_output=True, text=True, env=child_env())
    assert config.returncode == 0, config.stderr
    yaml_file, = (f for f in folder.glob("*.yaml") if f.stem != recipe)  # beside it: the resolved recipe
    env = child_env(FUSED_VARIANTS=variants, **({} if recipe.startswith("zero") else {"ACCELERATE_USE_CPU": "true"}))
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml_file),
                           "--main_process_port", str(free_port()), str(REPO / "tests" / "workers" / "fused_vs_plain.py"),
                           str(folder / "out.json"), recipe, *words], capture_output=True, text=True, env=env,
                          timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((folder / "out.json").read_text())


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Every engine's launch, two at a time."""
    base = tmp_path_factory.mktemp("engines")
    jobs = SideBySide({name: (lambda core, name=name, e=e: fused_vs_plain(base / name, *e)) for name, e in zip(IDS, ENGINES)})
    yield jobs
    jobs.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("recipe, overrides, variants", ENGINES, ids=IDS)
def test_fused_equals_plain_on_every_engine(engines, request, recipe, overrides, variants):
    results = engines(request.node.callspec.id)
    assert list(results) == ["base", *filter(None, variants.split(","))]
    for variant, r in results.items():
        assert r["num_processes"] == 2 and r["distributed_type"] == {"ddp": "MULTI_CPU", "zero2": "DEEPSPEED",
                                                                      "zero3-offload": "DEEPSPEED"}.get(recipe, "FSDP")
        assert r["targets"] > 2 * r["chunk_max"] and r["chunk_max"] <= 7 and r["plain_chunks"] == 0, (variant, r)
        assert r["chunk_tokens"] % r["targets"] == 0 and r["chunk_tokens"] >= 2 * r["targets"], (variant, r)  # fused
        lora_head = variant == "lora-head" or "lm_head" in " ".join(overrides)
        assert r["head_lora"] is lora_head and r["z3_leaf"] is lora_head, (variant, r)  # a wrapped head: gathered whole
        assert r["tied"] is (variant == "tied"), (variant, r)
        assert r["fused_loss"] == pytest.approx(r["plain_loss"], rel=1e-6), variant
        assert r["max_grad"] > 0.1 and r["max_grad_diff"] < 1e-5 * max(1.0, r["max_grad"]), (variant, r)  # of their scale
        assert r["head_grads"] >= 1  # the head trains: its own weights, or its adapters
        assert r["max_eval_diff"] < 1e-6 * max(10.0, r["max_eval"]), (variant, r)  # fp32: a few ulps of a packed row


def test_loss_memory_profiles_the_first_micro_batch_only():
    """The CPU profile that measures the loss stops when the next micro batch's forward starts: the
    rest of the first window trains at full speed, and the figure is read from the first one."""
    model, b = tiny_model(), batch()
    memory = LossMemory(model, torch.device("cpu"))
    lm_loss(model, b).backward()
    assert torch.autograd.profiler._is_profiler_enabled
    lm_loss(model, b).backward()  # the second micro batch of the window
    assert not torch.autograd.profiler._is_profiler_enabled
    assert memory.bytes > 0
