"""LoRA's options under peft's names: each trains, saves, reloads onto the original base and merges to
the trained model's logits; the planner's model states equal what the model holds after a step."""

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import loop_model
from memrecipe.planning.architecture import read_config, structure
from memrecipe.training.checkpoint import save_final
from memrecipe.errors import RecipeError
from memrecipe.training.probes import held_bytes
from memrecipe.planning.registry import EMBEDDED_MODEL
from memrecipe.training.adapters import rewrites_base, save_initial_adapter
from memrecipe.training.optimizers import make_optimizer
from memrecipe.planning.planner import estimate
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology

OPTIONS = {  # (overrides, how many tensors train beside the adapters' A and B)
    "modules_to_save+bias-lora-only": (["lora.modules_to_save=[embed_tokens,lm_head]", "lora.bias=lora_only",
                                        "lora.target_modules=[q_proj,v_proj]"], 2 + 4 * 2),
    "bias-all": (["lora.bias=all", "lora.target_modules=[q_proj,v_proj]"], 4 * 7),  # 4 layers x 7 linears
    "dora": (["lora.use_dora=true"], 0),
    "rslora+gaussian": (["lora.use_rslora=true", "lora.init_lora_weights=gaussian"], 0),
    "pissa": (["lora.init_lora_weights=pissa"], 0),
    "olora": (["lora.init_lora_weights=olora"], 0),
}
# one process, fp32 (mixed_precision=no): the converted PiSSA/OLoRA adapter is then exact to float rounding
COMMON = ["mixed_precision=no", "lora.dropout=0.0", "learning_rate=1e-2"]
ACCELERATOR = SimpleNamespace(unwrap_model=lambda m: m, is_main_process=True, get_state_dict=lambda m: m.state_dict(),
                              distributed_type=SimpleNamespace(value="NO"), device=torch.device("cpu"))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The embedded model's config with biases on every linear (for `bias`), saved as a hub model would be."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("biased")
    config = json.loads((EMBEDDED_MODEL / "config.json").read_text()) | {"attention_bias": True, "mlp_bias": True}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**config)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("option", OPTIONS)
def test_each_lora_option_trains_saves_reloads_and_merges_to_the_trained_logits(base, tmp_path, option):
    from peft import PeftModel

    overrides, extra = OPTIONS[option]
    recipe = load_recipe("single-gpu-lora", [*COMMON, *overrides, f"model_name_or_path={base}"])
    torch.manual_seed(0)
    model, _ = loop_model(recipe, str(base), "no")
    initial = tmp_path / "initial_adapter" if rewrites_base(recipe) else None
    if initial is not None:
        save_initial_adapter(model, initial)
    optimizer = make_optimizer(recipe, model, ACCELERATOR)
    ids = torch.randint(0, 500, (3, 2, 24), generator=torch.Generator().manual_seed(1))
    for step, batch in enumerate(ids):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        if step == 0:  # the planner's model states against what is held once the optimizer state exists
            held = held_bytes(model, optimizer)
            plan = estimate(recipe, structure(read_config(str(base))), Topology(cpu=True))
            for category in ("parameters", "gradients", "optimizer_state"):
                assert held[category] == pytest.approx(getattr(plan, category), rel=0.01), category
        optimizer.zero_grad()
    beside = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    assert len(beside) == extra, beside  # the copies / the biases the option trains, nothing else
    model.eval()
    probe = torch.randint(0, 500, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=probe).logits
    save_final(ACCELERATOR, model, tmp_path / "final", initial)

    original = lambda: AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)  # noqa: E731
    with torch.no_grad():
        before = original()(input_ids=probe).logits
        reloaded = PeftModel.from_pretrained(original(), tmp_path / "final")
        got = reloaded(input_ids=probe).logits
        merged = reloaded.merge_and_unload()(input_ids=probe).logits
    assert (want - before).abs().max() > 1e-2  # training moved the logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(merged, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("overrides, reason", [
    (["lora.init_lora_weights=pissa", "lora.use_dora=true"], "lora.use_dora cannot be converted back"),
    (["lora.init_lora_weights=olora"], "rewrites the base as it loads, which memrecipe supports on one process or DDP"),
    (["lora.init_lora_weights=pisa"], "did you mean 'pissa'"),
    (["lora.bias=some"], "lora.bias must be one of none, all, lora_only"),
])
def test_lora_options_that_cannot_work_are_refused_with_the_reason(overrides, reason):
    recipe = "fsdp-lora" if "olora" in overrides[0] else "single-gpu-lora"
    with pytest.raises(RecipeError, match=reason):
        load_recipe(recipe, overrides)
    with pytest.raises(RecipeError, match="modules_to_save names 'lm_heads'"):
        estimate(load_recipe("single-gpu-lora", ["lora.modules_to_save=[lm_heads]"]), structure(read_config(None)),
                 Topology(cpu=True))


def peft_path(model) -> None:
    """Undo share_inputs: every adapter casts its input to fp32 and drops out as peft's own forward does."""
    for module in model.modules():
        for name, linear in getattr(module, "lora_A", {}).items():
            if hasattr(linear, "input_dropout"):
                module.lora_dropout[name] = linear.input_dropout
                del linear.input_dropout, linear.forward
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = True


@pytest.mark.parametrize("recipe", ["single-gpu-lora", "qlora"])  # peft's Linear; bitsandbytes' Linear4bit
@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_adapters_share_their_input_redraw_their_dropout_and_train_bitwise_as_peft(dropout, recipe):
    """Under autocast, adapters read their layer's 16-bit input as it comes and, with dropout, redraw it in backward
    (share_inputs): the loss and every gradient are bitwise peft's own path, and the forward leaves fewer bytes for
    backward (q, k and v keep one tensor, not three copies; no masks, no dropped copies)."""
    from helpers import loop_model
    from measuring import batch, held_after_forward
    from memrecipe.planning.registry import load_recipe
    from memrecipe.training.loading import embedded_model

    recipe = load_recipe(recipe, [f"lora.dropout={dropout}", "max_seq_length=48", "gradient_checkpointing=false"])
    runs = {}
    for shared in (True, False):
        torch.manual_seed(0)
        model, _ = loop_model(recipe, embedded_model(), "bf16")  # (the loop's setup: share_inputs under autocast)
        model.train()
        if not shared:
            peft_path(model)
        torch.manual_seed(1)
        runs[shared] = held_after_forward(model, batch(model.config.vocab_size), autocast=True)
    assert runs[True][0] == runs[False][0]
    for name, grad in runs[False][2].items():
        assert torch.equal(runs[True][2][name], grad), name
    assert runs[True][1] < (0.6 if dropout else 0.9) * runs[False][1], (runs[True][1], runs[False][1])


def test_the_report_counts_the_lora_layers_whose_adapters_share_their_inputs_and_redraw_as_the_plan_says():
    """The loop redraws LoRA's dropout exactly where the plan counts a redraw (Recipe.keeps_dropout, one rule): under
    autocast and under DeepSpeed's bf16 engine, with `lora.redraw_dropout: auto` left undecided too (the shipped
    default, as a copied script meets it: the memory-safe choice); not with compiled layers, not in fp32 (no
    autocast), not with lora.redraw_dropout=false."""
    from types import SimpleNamespace

    from helpers import loop_model
    from memrecipe.planning.registry import load_recipe
    from memrecipe.training.loading import embedded_model
    from memrecipe.training.facts import describe_setup

    counted, planned = {}, {}
    for words in (["lora.dropout=0.0"], ["lora.dropout=0.05"], ["lora.dropout=0.05", "torch_compile=true"],
                  ["lora.dropout=0.05", "mixed_precision=no"], ["lora.dropout=0.05", "lora.redraw_dropout=false"],
                  ["lora.dropout=0.05", "zero3-ulysses"]):
        name, engine = ("zero3-ulysses", "DEEPSPEED") if "zero3-ulysses" in words else ("single-gpu-lora", "NO")
        lora = ["lora.r=8", "lora.target_modules=all-linear"] if engine == "DEEPSPEED" else []
        recipe = load_recipe(name, [*lora, *(w for w in words if w != name)])
        assert recipe.lora.redraw_dropout == ("auto" if "lora.redraw_dropout=false" not in words else False)
        precision = "no" if "mixed_precision=no" in words else "bf16"
        model, _ = loop_model(recipe, embedded_model(), precision, engine=engine)
        accelerator = SimpleNamespace(distributed_type=SimpleNamespace(value=engine), num_processes=1, process_index=0,
                                      device="cpu", mixed_precision=precision, unwrap_model=lambda m: m)
        setup = describe_setup(accelerator, model, None)
        counted[" ".join(words)] = setup.lora_shared_inputs, setup.lora_recomputed_dropout
        planned[" ".join(words)] = not recipe.keeps_dropout and bool(recipe.lora.dropout)
    layers = sum(1 for name, _ in model.named_modules() if name.endswith(("q_proj", "down_proj")))  # 2 a decoder layer
    linears = 7 * layers // 2  # every linear of every layer
    assert counted == {"lora.dropout=0.0": (linears, 0), "lora.dropout=0.05": (linears, linears),
                       "lora.dropout=0.05 torch_compile=true": (0, 0),  # compiled layers keep peft's dropout
                       "lora.dropout=0.05 mixed_precision=no": (0, 0),  # fp32: peft's forward as it is
                       "lora.dropout=0.05 lora.redraw_dropout=false": (0, 0),
                       "lora.dropout=0.05 zero3-ulysses": (linears, linears)}  # the engine's bf16 adapters
    assert {words: bool(redrawn) for words, (_, redrawn) in counted.items()} == planned


def test_a_frozen_embeddings_output_is_not_held_to_the_end_of_backward():
    """Under LoRA with the activation offload, the embedding's output goes to host memory with the first layer's
    checkpoint: nothing keeps the tensor itself (transformers' and peft's hooks made it a leaf that requires grad,
    which autograd held until backward ended). The adapters' gradients are the same without those hooks."""
    import gc
    import weakref

    from helpers import loop_model
    from measuring import batch
    from memrecipe.planning.registry import load_recipe
    from memrecipe.training.adapters import drop_input_grads
    from memrecipe.training.loading import embedded_model
    from memrecipe.training.loss import lm_loss

    recipe = load_recipe("single-gpu-lora", ["activation_offload=true", "lora.dropout=0.0"])
    grads = {}
    for dropped in (True, False):
        torch.manual_seed(0)
        model, offload = loop_model(recipe, embedded_model(), "bf16")
        offload.copy_on_cpu = True  # a separate host copy, as on CUDA
        assert drop_input_grads(model) == 0  # add_lora removed them
        if not dropped:  # the hook transformers' checkpointing and peft add, put back
            model.get_base_model().enable_input_require_grads()
        outputs = []
        model.get_input_embeddings().register_forward_hook(lambda m, i, o, outputs=outputs: outputs.append(weakref.ref(o)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, batch(model.config.vocab_size))
        gc.collect()
        assert (outputs[0]() is None) is dropped  # held to the end of backward only with the hooks
        loss.backward()
        grads[dropped] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 0
    for name, grad in grads[True].items():
        assert torch.equal(grad, grads[False][name]), name


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_under_deepspeeds_bf16_engine_every_adapter_holds_bf16_the_frozen_reference_too(tmp_path, dropout):
    """DeepSpeed's bf16 engine computes without autocast, and ZeRO-3 built under zero.Init leaves parameters as they
    come (engine.py, _cast_module_mixed_precision): the adapters take the engine's bf16 (add_lora), the one that trains
    and DPO's frozen reference beside it, which would otherwise meet its bf16 input in fp32 ("expected m1 and m2 to
    have the same dtype" where the adapters read their input uncast). A forward and backward run in bf16, the
    reference's log-probs too, and with dropout the adapters redraw it in backward, in bf16."""
    from memrecipe.training.adapters import REFERENCE_ADAPTER, add_lora
    from memrecipe.training.loading import embedded_model

    words = ["lora.r=4", "lora.target_modules=all-linear", f"lora.dropout={dropout}"]
    model, _ = loop_model(load_recipe("single-gpu-lora", words), embedded_model(), "bf16")
    model.save_pretrained(tmp_path / "saved")
    base = AutoModelForCausalLM.from_pretrained(embedded_model(), dtype=torch.bfloat16)
    engine = SimpleNamespace(native_amp=False, mixed_precision="bf16", distributed_type=SimpleNamespace(value="DEEPSPEED"))
    lora = load_recipe("single-gpu-lora", [*words, f"lora.adapter={tmp_path / 'saved'}"]).lora
    model = add_lora(base, lora, reference=True, accelerator=engine)
    assert REFERENCE_ADAPTER in model.peft_config
    assert {p.dtype for n, p in model.named_parameters() if ".lora_" in n} == {torch.bfloat16}
    assert any(hasattr(m, "input_dropout") for m in model.modules()) == bool(dropout)  # redrawn (recompute_dropout)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    model.set_adapter(REFERENCE_ADAPTER)  # (DPO's reference pass: the frozen copy, no gradient)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
