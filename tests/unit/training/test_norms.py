"""The lean RMSNorm (training.norms): the module's own output bit for bit, autograd's gradients to rounding, with
less kept for backward and a smaller backward peak."""

import re

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from measuring import profiled_peak
from memrecipe.training.norms import LeanRMSNorm, is_llama_norm, lean_norms

# (input dtype, weight dtype): bf16 LoRA/full over a bf16 base, fp32, QLoRA's fp32 norms over a 16-bit stream
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)]


def norm_and_input(x_dtype, w_dtype, train_weight, tokens=50, width=64):
    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(width, eps=1e-5).to(w_dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(width, generator=g))
    norm.weight.requires_grad_(train_weight)
    x = (3 * torch.randn(2, tokens // 2, width, generator=g)).to(x_dtype).requires_grad_()
    return norm, x, torch.randn(2, tokens // 2, width, generator=g).to(torch.promote_types(x_dtype, w_dtype))


@pytest.mark.parametrize("x_dtype, w_dtype", DTYPES)
@pytest.mark.parametrize("train_weight", [True, False])
def test_the_output_is_the_modules_and_the_gradients_autograds(x_dtype, w_dtype, train_weight):
    norm, x, upstream = norm_and_input(x_dtype, w_dtype, train_weight)
    plain = norm(x)
    plain.backward(upstream)
    expected = x.grad, norm.weight.grad
    x.grad, norm.weight.grad = None, None
    lean = LeanRMSNorm.apply(x, norm.weight, norm.variance_epsilon, 7)  # 7 rows a tile: 8 tiles, the last short
    assert lean.dtype == plain.dtype and torch.equal(lean, plain)
    lean.backward(upstream)
    tolerance = 1e-5 if x_dtype == torch.float32 else 1e-2  # one bf16 rounding of a sum taken in another order
    torch.testing.assert_close(x.grad, expected[0], rtol=tolerance, atol=tolerance * expected[0].abs().max().item())
    if train_weight:
        torch.testing.assert_close(norm.weight.grad, expected[1], rtol=tolerance,
                                   atol=tolerance * expected[1].abs().max().item())
        assert norm.weight.grad.dtype == w_dtype
    else:
        assert norm.weight.grad is None


def saved_bytes(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return out, sum(storages.values())


def test_it_keeps_its_input_and_a_number_per_token_where_the_module_keeps_an_fp32_copy():
    norm, x, upstream = norm_and_input(torch.bfloat16, torch.bfloat16, train_weight=False, tokens=512, width=256)
    _, plain = saved_bytes(lambda: norm(x))
    _, lean = saved_bytes(lambda: LeanRMSNorm.apply(x, norm.weight, norm.variance_epsilon, 64))
    tokens, width = 512, 256
    assert plain >= 4 * tokens * width  # the fp32 copy of the input
    assert lean == 2 * tokens * width + 4 * tokens + 2 * width  # the input itself (bf16), the rsqrt, the weight

    def step(forward):
        def run():
            forward().backward(upstream)
        return run

    peaks = [profiled_peak(step(lambda: norm(x))),
             profiled_peak(step(lambda: LeanRMSNorm.apply(x, norm.weight, norm.variance_epsilon, 64)))]
    # the module's backward: fp32 buffers over the whole input; the lean one: the bf16 gradient and a tile's fp32
    assert peaks[1] < 0.5 * peaks[0], peaks
    assert peaks[1] <= 2 * 2 * tokens * width + 6 * 4 * 64 * width + 8 * tokens, peaks


def test_a_models_llama_norms_run_lean_and_train_the_same(models):
    from transformers import AutoModelForCausalLM

    from measuring import batch
    from memrecipe.training.loss import lm_loss

    def loss_and_grads(lean):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(models["tiny"], dtype=torch.float32)
        count = lean_norms(model) if lean else 0
        loss = lm_loss(model, batch(model.config.vocab_size))
        loss.backward()
        return count, loss, {n: p.grad for n, p in model.named_parameters()}

    (_, loss, grads), (count, lean_loss, lean_grads) = loss_and_grads(False), loss_and_grads(True)
    layers = AutoModelForCausalLM.from_pretrained(models["tiny"]).config.num_hidden_layers
    assert count == 2 * layers + 1  # each layer's two and the final one
    assert torch.equal(lean_loss, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(lean_grads[name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item(), msg=name)


def test_norms_that_compute_otherwise_are_left_alone():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    assert is_llama_norm(Qwen3RMSNorm(8)) and is_llama_norm(LlamaRMSNorm(8))
    assert not is_llama_norm(GemmaRMSNorm(8))  # (1 + weight), fp32 to the end


def test_the_loop_runs_a_recipes_norms_lean_in_bf16_and_trains_the_same(models, monkeypatch):
    """single-gpu-lora with lean_norms=true, built by recipes/sft.py's own setup, which leaves it in training mode
    before the facts are read, and put in training mode again as the loop does: every norm of a step runs lean
    (transformers 5.25's model.train() re-kernelizes a model loaded with hub kernels on, which undid them), and a
    bf16 step's loss and adapter gradients are plain norms' to bf16 rounding."""
    from helpers import loop_model
    from measuring import batch
    from memrecipe.planning.registry import load_recipe
    from memrecipe.training.loss import lm_loss

    calls = []  # each LeanRMSNorm the forward runs (what the step really ran, not what was set up)
    forward = LeanRMSNorm.forward
    monkeypatch.setattr(LeanRMSNorm, "forward", staticmethod(lambda *a: calls.append(1) or forward(*a)))

    def step(lean):
        torch.manual_seed(0)
        calls.clear()
        model, _ = loop_model(load_recipe("single-gpu-lora", [f"lean_norms={str(lean).lower()}", "lora.dropout=0"]),
                              models["tiny"], "bf16")
        assert all(m.training for m in model.modules())  # (what the start-up lines and report.json read)
        model.train()  # (recipes/sft.py's, before its first step)
        norms = 2 * model.config.num_hidden_layers + 1  # each layer's two and the final one
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, batch(model.config.vocab_size))
        lean = len(calls)
        loss.backward()
        return (lean, norms), loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    ((none, _), loss, grads), ((lean, norms), lean_loss, lean_grads) = step(False), step(True)
    assert none == 0 and lean == norms
    torch.testing.assert_close(lean_loss, loss, rtol=1e-3, atol=0)
    assert grads.keys() == lean_grads.keys() and len(grads) > 4
    for name, grad in grads.items():
        torch.testing.assert_close(lean_grads[name], grad, rtol=0.05, atol=0.02 * grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("name, words, says", [
    ("single-gpu-lora", ["torch_compile=true"], "set lean_norms=false or torch_compile=false"),
    ("tp", [], "set lean_norms=false or parallelism=null")])
def test_what_lean_norms_cannot_run_with_is_one_line(name, words, says):
    """(The rungs' rules run after the others: a recipe refused for another reason too, fsdp with torch_compile,
    is told that one first.)"""
    from memrecipe.errors import RecipeError
    from memrecipe.planning.registry import load_recipe

    with pytest.raises(RecipeError, match=re.escape(says)):
        load_recipe(name, ["lean_norms=true", *words])


def test_the_planners_list_of_models_whose_norms_run_lean_is_the_loops():
    """planning/architecture.LEAN_NORM_TYPES (torch-free, what the plan credits) against training.norms.is_llama_norm
    (what the loop replaces): every RMSNorm class of each listed model type is Llama's, and Gemma's and OLMo2's are
    not (lean_norms leaves them: the plan must not credit it there)."""
    import importlib

    from memrecipe.planning.architecture import LEAN_NORM_TYPES

    def llama_norms(model_type):
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        norms = [v for k, v in vars(module).items() if k.endswith("RMSNorm") and isinstance(v, type)]
        return bool(norms) and all(is_llama_norm(cls.__new__(cls)) for cls in norms)

    assert [t for t in sorted(LEAN_NORM_TYPES) if not llama_norms(t)] == []
    assert [t for t in ("gemma", "gemma2", "gemma3", "olmo2") if llama_norms(t)] == []
