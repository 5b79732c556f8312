"""training/tiling.py: the tiled MLP trains as the plain one (fp32 to 1e-5; bf16 autocast to its rounding) with and
without checkpointing, its backward recomputes each tile with the forward's own dropout masks and autocast, its
MLP tensors exist a tile at a time, and what it cannot run with is one line."""

import re

import pytest
import torch

from helpers import loop_model
from measuring import batch, held_after_forward
from memrecipe.errors import RecipeError
from memrecipe.planning.registry import load_recipe
from memrecipe.training.loading import embedded_model
from memrecipe.planning.activations import tile_count
from memrecipe.training.tiling import TiledMLP, tile_mlps


def trained(tiles, precision, *words):
    recipe = load_recipe("single-gpu-lora", [f"tiled_mlp={tiles}", "max_seq_length=48", *words])
    torch.manual_seed(0)
    model, _ = loop_model(recipe, embedded_model(), precision)
    model.train()
    torch.manual_seed(1)
    return held_after_forward(model, batch(model.config.vocab_size), autocast=precision == "bf16")


@pytest.mark.parametrize("precision, tolerance", [("no", 1e-5), ("bf16", 2e-2)])
@pytest.mark.parametrize("checkpointing", ["true", "false"])
def test_a_tiled_mlp_trains_as_the_plain_one(precision, tolerance, checkpointing):
    """Without dropout (its masks are drawn tile by tile, in another order than over the whole sequence), every
    gradient is the plain MLP's: in fp32 to 1e-5, under bf16 autocast to bf16's rounding of sums over 4 tiles."""
    words = ["lora.dropout=0", f"gradient_checkpointing={checkpointing}"]
    plain, tiled = trained("false", precision, *words), trained(4, precision, *words)
    assert tiled[0] == pytest.approx(plain[0], rel=1e-6) and tiled[2].keys() == plain[2].keys()
    for name, grad in plain[2].items():
        scale = max(1.0, grad.abs().max().item())
        torch.testing.assert_close(tiled[2][name], grad, rtol=0, atol=tolerance * scale, msg=name)
    if checkpointing == "false":  # every layer's MLP tensors are gone: 4 layers x (3 x 352 + adapters) per token
        assert tiled[1] < 0.6 * plain[1], (tiled[1], plain[1])


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_the_backward_draws_the_forwards_dropout_masks_and_runs_under_its_autocast(precision):
    """The tiled MLP's gradients equal autograd's through the same tiles and dropout masks (p 0.3): the recompute
    replays each tile's random state (red without it) and re-enters the forward's autocast (a bf16 base under fp32
    adapters fails without it). In fp32 to the order of the tiles' sums; under bf16 autocast to bf16's rounding:
    autograd sums the tiles' weight gradients in bf16 at the cached weight cast, the tiles here in fp32."""
    recipe = load_recipe("single-gpu-lora", ["lora.dropout=0.3"])
    torch.manual_seed(0)
    model, _ = loop_model(recipe, embedded_model(), precision)
    model.train()
    mlp = model.base_model.model.model.layers[0].mlp
    x = torch.randn(2, 40, model.config.hidden_size, requires_grad=True)
    results = []
    for tiled in (False, True):
        model.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            if tiled:
                y = TiledMLP.apply(mlp.forward, x, 5, [])
            else:  # the same tiles, the same draws, with autograd keeping everything
                y = torch.cat([mlp.forward(part) for part in x.reshape(-1, x.shape[-1]).chunk(5)]).view(2, 40, -1)
        (y.float() ** 2).sum().backward()
        results.append((x.grad.clone(), {n: p.grad.clone() for n, p in mlp.named_parameters() if p.grad is not None}))
    (x_plain, plain), (x_tiled, tiled) = results
    torch.testing.assert_close(x_tiled, x_plain, rtol=1e-5, atol=1e-5 * x_plain.abs().max().item())
    assert plain.keys() == tiled.keys() and plain
    tolerance = 1e-5 if precision == "no" else 1e-2
    for name, grad in plain.items():
        torch.testing.assert_close(tiled[name], grad, rtol=0, atol=tolerance * grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_a_recompute_without_the_tiled_mlp_gives_its_gradients_with_dropout(monkeypatch, precision):
    """The layer's recompute leaves the tiled MLP out (TiledMLP's idle_in_recompute): with LoRA's dropout (p 0.3, in
    the MLP's adapters and before it) the loss and every gradient are those of a recompute that runs it, bitwise:
    the masks before the MLP are drawn again from the checkpoint's random state, the tiles' backward replays the
    forward's own, and nothing after a Llama layer's MLP draws."""
    from memrecipe.training import tiling

    words = ["lora.dropout=0.3", "gradient_checkpointing=true"]
    skipped = trained(4, precision, *words)
    monkeypatch.setattr(tiling, "mlp_output_unsaved", lambda layer: False)
    computed = trained(4, precision, *words)
    assert skipped[0] == computed[0] and skipped[2].keys() == computed[2].keys() and skipped[2]
    for name, grad in computed[2].items():
        assert torch.equal(skipped[2][name], grad), name


@pytest.mark.parametrize("words", [["lora.dropout=0.3"], ["lora.dropout=0", "lora.target_modules=[gate_proj,up_proj,down_proj]"]])
def test_every_adapter_trains_under_the_tiled_rung_the_first_layers_too(words):
    """Tiles read trained weights that their input need not lead to: the first layer's q, k and v read the frozen
    embedding's normed output, and an MLP-only LoRA's first MLP reads that plus a frozen attention's, none of which
    requires grad. Their tiles' output then required none either: under the top rung with LoRA's dropout (redrawn a
    tile at a time) those three adapters' A trained nothing, a wrong result, and an MLP-only LoRA died in backward
    ("element 0 of tensors does not require grad"). The trained weights are now the tiles' inputs (TiledMLP): every
    adapter has a gradient, and without dropout the MLP-only one is the untiled model's to bf16's rounding."""
    grads = {}
    for tiles in ("false", "4"):
        recipe = load_recipe("single-gpu-lora", [f"tiled_mlp={tiles}", *words])
        torch.manual_seed(0)
        model, _ = loop_model(recipe, embedded_model(), "bf16")
        model.train()
        for name, p in model.named_parameters():
            if "lora_B" in name:  # (B starts at zero, and A's gradient with it)
                p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        ids = torch.randint(4, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(2))
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids).loss.backward()
        grads[tiles] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    untrained = [n for n, g in grads["4"].items() if g is None or not g.any()]
    assert not untrained and len(grads["4"]) == len(grads["false"]), untrained
    if "lora.dropout=0" in words:
        for name, grad in grads["4"].items():
            plain = grads["false"][name]
            torch.testing.assert_close(grad, plain, rtol=0, atol=2e-2 * plain.abs().max().item()), name


def test_under_deepspeed_a_tiled_redraw_gives_zero_the_adapters_gradient_once_whole():
    """ZeRO takes a parameter's gradient at each accumulation unless it is marked not ready (`ds_grad_is_ready`,
    stage3.py), and asserts a parameter once a bucket: with o_proj's and q/k/v's redraws in tiles under zero3-ulysses
    on 2 processes, `memrecipe run` died at its first backward. Under DeepSpeed (tiling.tile_redraws) each
    accumulation of an adapter's gradient but its last tile's is marked not ready, and the last holds the whole: the
    gradient equal to the same tiles' without the marks."""
    from memrecipe.training.adapters import dropped_forward
    from memrecipe.training.tiling import tile_redraws

    recipe = load_recipe("single-gpu-lora", ["lora.dropout=0.3"])
    grads, seen = [], []
    for deepspeed in (False, True):
        torch.manual_seed(0)
        model, _ = loop_model(recipe, embedded_model(), "bf16")
        assert tile_redraws(model, 4, deepspeed=deepspeed) == 4 * model.config.num_hidden_layers
        adapter = model.base_model.model.model.layers[0].self_attn.o_proj.lora_A["default"]
        assert adapter.forward.func is not dropped_forward
        marks = []
        adapter.weight.register_post_accumulate_grad_hook(
            lambda p, marks=marks: marks.append(getattr(p, "ds_grad_is_ready", True)))
        x = torch.randn(2, 40, adapter.in_features, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = adapter(x)
        (y.float() ** 2).sum().backward()
        grads.append(adapter.weight.grad.clone())
        seen.append(marks)
    assert seen == [[True] * 4, [False, False, False, True]]
    assert torch.equal(grads[1], grads[0]) and grads[0].abs().sum() > 0


def test_the_adapters_outside_the_mlp_redraw_their_dropout_a_tile_at_a_time():
    """Under tiled_mlp with LoRA's dropout, in bf16 (where the adapters redraw their dropout: adapters.share_inputs),
    the adapters of q, k, v and o_proj (the MLP's are inside its tiles) run their cast, dropout and A a tile at a
    time (tiling.tile_redraws: their redraw is then a tile's, not the whole sequence's): the output is bitwise, and
    the gradients are, to bf16's rounding, autograd's through the same tiles and masks (p 0.3)."""
    from memrecipe.training.adapters import dropped
    from memrecipe.training.tiling import tiled_redraw

    recipe = load_recipe("single-gpu-lora", ["lora.dropout=0.3", "tiled_mlp=5"])
    torch.manual_seed(0)
    model, _ = loop_model(recipe, embedded_model(), "bf16")
    model.train()
    redraws = [name for name, module in model.named_modules()
               if getattr(getattr(module, "forward", None), "func", None) is tiled_redraw]
    assert len(redraws) == 4 * model.config.num_hidden_layers and not any(".mlp." in name for name in redraws)
    adapter = model.base_model.model.model.layers[0].self_attn.o_proj.lora_A["default"]
    _, casts, *_ = adapter.forward.args
    x = torch.randn(2, 40, adapter.in_features, requires_grad=True)
    results = []
    for tiled in (False, True):
        model.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if tiled:
                y = adapter(x)
            else:  # the same tiles, the same draws, with autograd keeping everything
                parts = x.reshape(-1, x.shape[-1]).chunk(5)
                y = torch.cat([dropped(adapter, casts(), part) for part in parts]).view(2, 40, -1)
        (y.float() ** 2).sum().backward()
        results.append((y.detach(), x.grad.clone(), adapter.weight.grad.clone()))
    (y_plain, x_plain, w_plain), (y_tiled, x_tiled, w_tiled) = results
    assert torch.equal(y_tiled, y_plain)
    torch.testing.assert_close(x_tiled, x_plain, rtol=0, atol=1e-2 * x_plain.abs().max().item())
    torch.testing.assert_close(w_tiled, w_plain, rtol=0, atol=1e-2 * w_plain.abs().max().item())


def test_the_tiled_backward_holds_the_inputs_gradient_once():
    """Each tile's input gradient lands in its slice of one tensor (DeepSpeed's TiledMLP does the same): a backward
    over 16 tiles of a bf16 [4096 x 256] input allocates its input's gradient and a tile's work, not the tiles'
    gradients and their concatenation beside them (2.1x the input's gradient, measured)."""
    from measuring import allocation_peak_of

    torch.manual_seed(0)
    up, down = torch.nn.Linear(256, 64, dtype=torch.bfloat16), torch.nn.Linear(64, 256, dtype=torch.bfloat16)
    x = torch.randn(4096, 256, dtype=torch.bfloat16, requires_grad=True)
    y = TiledMLP.apply(lambda part: down(up(part).relu()), x, 16, [])
    grad = torch.randn_like(y)
    peak = allocation_peak_of(lambda: y.backward(grad))
    assert x.grad.numel() * 2 <= peak < 1.3 * x.grad.numel() * 2, (peak, x.grad.numel() * 2)


def test_a_steps_measured_peak_holds_the_tiled_inputs_gradient_and_not_the_parameters():
    """The stand-in rows measure the tiled MLP's input gradient: the profiler calls every tensor autograd accumulates
    into a GRADIENT, also x_grad (each tile's leaf's .grad is its slice), and step_peak leaves the parameters'
    gradients out, not it (measuring.only_parameters_gradients). By category alone the backward read
    2 MiB low here, under the forward."""
    from measuring import profiled_peak

    torch.manual_seed(0)
    embed, up = torch.nn.Linear(256, 256, dtype=torch.bfloat16), torch.nn.Linear(256, 64, dtype=torch.bfloat16)
    x = torch.randn(4096, 256, dtype=torch.bfloat16)
    parameters = [*embed.parameters(), *up.parameters()]

    def step():
        for p in parameters:
            p.grad = None
        TiledMLP.apply(lambda part: up(part).relu(), embed(x), 16, []).sum().backward()

    gradient = x.numel() * 2  # the tiled MLP's input's, as large as its input
    by_category, by_address = profiled_peak(step), profiled_peak(step, parameters)
    # in backward its input (saved) and its gradient, a tile's work beside them; not the parameters' (0.3 MB)
    assert 2 * gradient <= by_address < 2.2 * gradient, by_address
    assert by_category < by_address - gradient / 2, (by_category, by_address)  # (its peak: the forward's)


def test_only_a_layer_whose_mlp_output_nothing_saves_leaves_it_out_of_its_recompute():
    """Llama's and Qwen's layers end `hidden_states = residual + hidden_states` after the MLP: the recompute may leave
    the MLP out. Gemma 2's norm after the MLP saves its output: its recompute runs the MLP."""
    from transformers import Gemma2Config, LlamaConfig
    from transformers.models.gemma2.modeling_gemma2 import Gemma2DecoderLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    from memrecipe.training.tiling import mlp_output_unsaved

    tiny = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 8}
    assert mlp_output_unsaved(LlamaDecoderLayer(LlamaConfig(**tiny), 0))
    assert mlp_output_unsaved(Qwen3DecoderLayer.__new__(Qwen3DecoderLayer))  # (read off its class's forward)
    assert not mlp_output_unsaved(Gemma2DecoderLayer(Gemma2Config(**tiny), 0))
    assert not mlp_output_unsaved(torch.nn.Linear(2, 2))


def test_tiles_are_about_a_hidden_size_of_tokens_or_the_number_given():
    assert (tile_count(True, 131072, 4096), tile_count(True, 100, 4096), tile_count(6, 100, 4096)) == (32, 1, 6)


@pytest.mark.parametrize("recipe, words, says", [
    ("fsdp", [], "tiled_mlp runs on one process or under DeepSpeed (told to wait for a weight's last tile): FSDP syncs"),
    ("single-gpu-full", [], "set tiled_mlp=false or optimizer_in_backward=false"),
    ("single-gpu-lora", ["torch_compile=true"], "set tiled_mlp=false or torch_compile=false"),
    ("single-gpu-lora", ["tiled_mlp=1"], "tiled_mlp must be true or false or an integer >= 2, got 1"),
])
def test_what_a_tiled_mlp_cannot_run_with_is_one_line(recipe, words, says):
    with pytest.raises(RecipeError, match=re.escape(says)):
        load_recipe(recipe, ["tiled_mlp=true", *words] if "tiled_mlp=1" not in words else words)


def test_ddp_on_more_than_one_process_is_refused_before_launch_and_deepspeed_is_not():
    from memrecipe.planning.topology import Topology, check_supported

    check_supported(load_recipe("adamw-8bit", ["tiled_mlp=true"]), Topology(1))  # the 8-bit optimizer on one GPU
    check_supported(load_recipe("zero3-offload", ["tiled_mlp=true"]), Topology(2))  # DeepSpeed waits for the last tile
    with pytest.raises(RecipeError, match="tiled_mlp runs on one process or under DeepSpeed: DDP syncs .* got 2 proc"):
        check_supported(load_recipe("ddp", ["tiled_mlp=true"]), Topology(2))


def test_a_model_without_dense_mlps_is_refused_in_one_line():
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_configs import TINY_MIXTRAL

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_MIXTRAL))
    with pytest.raises(RecipeError, match="tiled_mlp tiles dense MLPs; this model's layers have MixtralSparseMoeBlock"):
        tile_mlps(model, True)
