"""training/optimizers.py: the optimizers and what they hold: torchao's 8-bit AdamW on bf16 weights, APOLLO's low-rank state,
the step in backward; each measured after a real step on the embedded model against the plan."""

from types import SimpleNamespace

import pytest
import torch

from helpers import loop_model
from memrecipe.errors import RecipeError
from memrecipe.planning.architecture import read_config, structure
from memrecipe.planning.optimizers import OPTIMIZERS
from memrecipe.planning.planner import estimate
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology
from memrecipe.training.loading import embedded_model
from memrecipe.training.probes import held_bytes
from memrecipe.training.optimizers import StepInBackward, make_optimizer

CPU = SimpleNamespace(device=torch.device("cpu"))
IN_BACKWARD = ["optimizer_in_backward=true", "max_grad_norm=null", "gradient_accumulation_steps=1"]
FULL = ["lora=null", "quantization=null"]  # single-gpu-lora made a full fine-tune: one process, no engine


def full(*overrides):
    return load_recipe("single-gpu-lora", [*FULL, *overrides])


def trained(recipe, steps=1, seed=0):
    """The embedded model after `steps` real optimizer steps on fixed random batches."""
    torch.manual_seed(seed)
    model, _ = loop_model(recipe, embedded_model(), "bf16" if recipe.weight_dtype == "bf16" else "no")
    optimizer = make_optimizer(recipe, model, CPU)
    batches = torch.randint(0, 500, (steps, 2, 32), generator=torch.Generator().manual_seed(seed))
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        held = held_bytes(model, optimizer)
        optimizer.zero_grad()
    return model, optimizer, held


@pytest.mark.parametrize("overrides", [
    ["weight_dtype=bf16", "optim=adamw_torch_8bit"],
    ["weight_dtype=bf16", "optim=adamw_torch_8bit", *IN_BACKWARD],
    ["weight_dtype=bf16", "optim=apollo_adamw", "optim_args.rank=8"],
    ["weight_dtype=bf16", "optim=apollo_adamw", "optim_args.rank=8", "optim_target_modules=[q_proj,v_proj]", *IN_BACKWARD],
    ["weight_dtype=bf16", "optim=adamw_torch"],
    ["weight_dtype=fp32", "optim=adamw_torch_8bit", *IN_BACKWARD],
], ids=["torchao-8bit", "torchao-8bit-in-backward", "apollo", "apollo-two-targets-in-backward", "adamw-bf16",
        "torchao-8bit-fp32"])
def test_held_model_states_equal_the_plan(overrides):
    recipe = full(*overrides)
    _, _, held = trained(recipe)
    plan = estimate(recipe, structure(read_config(None)), Topology(cpu=True))
    for category in ("parameters", "gradients", "optimizer_state"):
        assert held[category] == getattr(plan, category), category  # exact: a lost 4-byte step counter shows


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_of_the_table_builds_and_holds_its_planned_state(name):
    """One entry in planning/optimizers.py is the whole of an optimizer: the schema takes its name, the
    factory builds it from the entry's builder, the planner counts its state from the entry (exactly)."""
    recipe = full(f"optim={name}", *(["optim_args.rank=8"] if OPTIMIZERS[name].low_rank else []))
    model, optimizer, held = trained(recipe)
    assert optimizer.state and all(torch.isfinite(p).all() for p in model.parameters())
    plan = estimate(recipe, structure(read_config(None)), Topology(cpu=True))
    assert held["optimizer_state"] == plan.optimizer_state


@pytest.mark.parametrize("in_backward", [False, True], ids=["one-step", "in-backward"])
def test_apollos_step_temporaries_are_planned(in_backward):
    """APOLLO on bf16 weights, profiled at its second step: at a projection refresh (update_proj_gap=1) what the
    step allocates beyond its state is the plan's `step` within 5%; between refreshes no more than that. One step
    over all tensors: the largest tensor's temporaries and the previous tensor's last update; in backward, each
    tensor's own step (called here one tensor at a time, as the hooks do)."""
    from memrecipe.planning.states import step_temporaries, trainable_tensors
    from measuring import allocation_peaks_of

    peaks = {}
    for gap in (1, 200):
        recipe = full("weight_dtype=bf16", "optim=apollo_adamw", "optim_args.rank=8", f"optim_args.update_proj_gap={gap}",
                      *(IN_BACKWARD if in_backward else []))
        model, optimizer, _ = trained(recipe)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.randn_like(p) / 100
        # in backward: each tensor's own optimizer, stepped alone (as its hook does); each step's own peak
        peaks[gap] = max(allocation_peaks_of([o.step for o in optimizer.optimizers.values()] if in_backward
                                             else [optimizer.step]))
    planned = step_temporaries(recipe, trainable_tensors(recipe, structure(read_config(None))), 2)
    assert peaks[1] == pytest.approx(planned, rel=0.05) and peaks[200] <= planned, (peaks, planned)


def test_the_step_in_backward_holds_one_tensors_gradient():
    recipe = full("weight_dtype=bf16", "optim=adamw_torch_8bit")
    model, _, ordinary = trained(recipe)
    _, optimizer, in_backward = trained(full("weight_dtype=bf16", "optim=adamw_torch_8bit", *IN_BACKWARD))
    largest = max(p.numel() for p in model.parameters())
    assert ordinary["gradients"] == 2 * sum(p.numel() for p in model.parameters())  # the model's, in bf16
    assert in_backward["gradients"] == 2 * largest  # measured in the hooks: never more than one tensor's at once
    assert all(p.grad is None for p in optimizer.optimizers)  # and none outlives its update


@pytest.mark.parametrize("optim", ["adamw_torch", "apollo_adamw"])
def test_the_step_in_backward_gives_the_ordinary_steps_weights(optim):
    args = ["weight_dtype=fp32", f"optim={optim}", "optim_args.rank=8", "weight_decay=0.1"]
    ordinary, _, _ = trained(full(*args), steps=3)
    in_backward, _, _ = trained(full(*args, *IN_BACKWARD), steps=3)
    moved = 0
    for (name, a), b in zip(ordinary.named_parameters(), in_backward.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6, msg=name)
    reference, _ = loop_model(full(*args), embedded_model(), "no")
    moved = sum(not torch.equal(a, b) for a, b in zip(reference.parameters(), ordinary.parameters()))
    assert moved == len(list(reference.parameters()))  # every tensor was updated


def test_the_scheduler_sets_every_per_parameter_learning_rate():
    from transformers import get_scheduler

    model, _ = loop_model(full("weight_dtype=bf16", "optim=adamw_torch_8bit", *IN_BACKWARD), embedded_model(), "bf16")
    optimizer = make_optimizer(full("weight_dtype=bf16", "optim=adamw_torch_8bit", *IN_BACKWARD), model, CPU)
    assert isinstance(optimizer, StepInBackward)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=4)
    optimizer.step()
    scheduler.step()
    rates = [float(o.param_groups[0]["lr"]) for o in optimizer.optimizers.values()]
    recipe = full("weight_dtype=bf16", "optim=adamw_torch_8bit", *IN_BACKWARD)
    assert rates == pytest.approx([0.75 * recipe.learning_rate] * len(rates))


def test_embeddings_keep_fp32_state_through_a_checkpoint():
    recipe = full("weight_dtype=bf16", "optim=adamw_torch_8bit")
    model, optimizer, _ = trained(recipe)
    embedding = model.get_input_embeddings().weight
    assert optimizer.state[embedding]["exp_avg"].dtype == torch.float32
    layer = model.model.layers[0].self_attn.q_proj.weight
    assert optimizer.state[layer]["exp_avg"].codes.dtype == torch.uint8
    other, fresh, _ = trained(recipe, seed=1)
    fresh.load_state_dict(optimizer.state_dict())  # torch would cast state to the bf16 parameter's dtype
    loaded = fresh.state[other.get_input_embeddings().weight]["exp_avg"]
    assert loaded.dtype == torch.float32
    torch.testing.assert_close(loaded, optimizer.state[embedding]["exp_avg"], atol=0, rtol=0)


def test_a_paged_optimizers_loaded_state_is_paged_again(monkeypatch):
    """bitsandbytes pages a paged optimizer's large state (CUDA managed memory, which the driver may move to the host
    under pressure), but loads a checkpoint's as ordinary tensors that its first step moves into the allocator: the
    second GPU lease's resumed adamw-8bit run held none paged. Loaded, each state of >= 1e5 elements goes back into a
    paged buffer with its values (get_paged, CUDA-only, stood in for by a host tensor marked as it marks them)."""
    import bitsandbytes.functional as F

    from memrecipe.training.optimizers import bnb_adamw8bit

    def shapes():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(512, 256)), torch.nn.Parameter(torch.randn(64, 64))]

    trained = shapes()
    saved = bnb_adamw8bit(paged=False)(trained, lr=1e-3)
    for p in trained:
        p.grad = torch.randn_like(p)
    saved.step()
    made = []

    def get_paged(*shape, dtype=torch.float32, device=None):
        out = torch.full(shape, 7, dtype=dtype)
        out.is_paged, out.page_deviceid = True, 0
        made.append(out)
        return out

    monkeypatch.setattr(F, "get_paged", get_paged)
    params = shapes()
    loaded = bnb_adamw8bit(paged=True)(params, lr=1e-3)
    loaded.load_state_dict(saved.state_dict())
    large, small = (loaded.state[p] for p in params)
    assert {k for k, v in large.items() if getattr(v, "is_paged", False)} == {"state1", "state2"}
    assert not any(getattr(v, "is_paged", False) for v in small.values())  # under 1e5 elements: never paged
    for key in ("state1", "state2"):
        torch.testing.assert_close(large[key], saved.state[trained[0]][key], atol=0, rtol=0)
    assert all(any(t is m for m in made) for t in (large["state1"], large["state2"]))
    assert set(map(id, made)) <= set(map(id, loaded.page_mng.paged_tensors))  # prefetched and evicted with the rest


@pytest.mark.parametrize("overrides, words", [
    (["gradient_accumulation_steps=4"], ["gradient_accumulation_steps=1", "micro batches"]),
    (["weight_dtype=fp32", "mixed_precision=fp16"], ["loss scaler", "mixed_precision=bf16"]),
    (["mixed_precision=fp16"], ["weight_dtype bf16 computes in bf16", "mixed_precision=bf16"]),
    (["max_grad_norm=1.0"], ["cannot clip", "max_grad_norm=null"]),
])
def test_the_step_in_backward_refuses_what_it_cannot_do(overrides, words):
    with pytest.raises(RecipeError) as e:
        load_recipe("single-gpu-full", overrides)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_fp16_is_refused_wherever_the_run_resolves_to_it(monkeypatch):
    """The recipe's own fp16 is refused above; `auto` on a GPU without bf16 (a V100) and a launch config that says
    fp16 (it wins over the recipe in the loop) are refused too, for the step in backward and bf16 weights alike."""
    from accelerate.state import AcceleratorState

    from memrecipe.planning.topology import check_supported, make_topology
    from memrecipe.training.accelerator import make_accelerator

    volta = make_topology(1, bf16=False)
    for overrides, why in (([], "weight_dtype bf16 computes in bf16"),
                           (["weight_dtype=fp32"], "optimizer_in_backward cannot use fp16")):
        with pytest.raises(RecipeError, match=f"mixed_precision auto is fp16 on GPUs without bf16.*{why}"):
            check_supported(load_recipe("single-gpu-full", overrides), volta)
    check_supported(load_recipe("single-gpu-lora"), volta)  # LoRA trains in fp16 with loss scaling there
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    AcceleratorState._reset_state(True)  # an Accelerator made earlier in this process would keep its precision
    try:
        with pytest.raises(RecipeError, match="the launch config runs mixed_precision fp16, and weight_dtype bf16"):
            make_accelerator(load_recipe("single-gpu-full"))
    finally:
        AcceleratorState._reset_state(True)


def test_low_rank_optimizers_are_offered_in_ddp_and_adamw_8bit():
    for name in ("ddp", "adamw-8bit", "single-gpu-full"):
        recipe = load_recipe(name, ["optim=apollo_adamw", "optim_args={rank: 4, update_proj_gap: 50}"])
        assert recipe.optim_args.rank == 4 and recipe.optim_target_modules == "all-linear"
    with pytest.raises(RecipeError, match="optim_target_modules"):
        model, _ = loop_model(full("optim=apollo_adamw", "optim_target_modules=[c_attn]"), embedded_model(), "no")
        make_optimizer(full("optim=apollo_adamw", "optim_target_modules=[c_attn]"), model, CPU)


@pytest.mark.parametrize("optim", ["apollo_adamw", "adamw_torch_8bit"])
def test_a_checkpointed_optimizer_continues_exactly(tmp_path, optim):
    """Saved and loaded the way accelerate does (torch.save; torch.load with weights_only): APOLLO's
    projections and torchao's 8-bit state come back, and the next step is the uninterrupted one's."""
    from accelerate.utils import load

    args = ["weight_dtype=fp32", f"optim={optim}", "optim_args.rank=8", *IN_BACKWARD]
    whole, _, _ = trained(full(*args), steps=3)
    cut, optimizer, _ = trained(full(*args), steps=2)
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.bin")
    torch.save(cut.state_dict(), tmp_path / "model.bin")
    resumed, _ = loop_model(full(*args), embedded_model(), "no")
    resumed.load_state_dict(torch.load(tmp_path / "model.bin"))
    again = make_optimizer(full(*args), resumed, CPU)
    again.load_state_dict(load(tmp_path / "optimizer.bin"))
    ids = torch.randint(0, 500, (3, 2, 32), generator=torch.Generator().manual_seed(0))[2]
    resumed(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("in_backward", [False, True], ids=["one-optimizer", "per-parameter"])
def test_stochastic_rounding_lets_updates_below_half_a_bf16_step_move_the_weights(in_backward):
    """bf16 weights of 1.0 (a step of 2^-7 there) take 10 updates of -1e-3 (AdamW on a constant gradient: lr per
    step): rounded to nearest each is lost and the weights stay 1.0; rounded stochastically they reach ~0.99 on
    average. 8192 elements: the mean's noise is ~1e-4, far from both."""
    def after_ten_steps(rounding: bool):
        recipe = full("weight_dtype=bf16", "optim=adamw_torch_8bit", "learning_rate=1e-3", "weight_decay=0",
                      "warmup_steps=0", f"optim_args.bf16_stochastic_round={str(rounding).lower()}",
                      *(IN_BACKWARD if in_backward else []))
        torch.manual_seed(0)
        layer = torch.nn.Linear(128, 64, bias=False).to(torch.bfloat16)
        torch.nn.init.ones_(layer.weight)
        optimizer = make_optimizer(recipe, layer, CPU)
        for _ in range(10):
            layer.weight.sum().backward()  # a gradient of 1 everywhere
            optimizer.step()
            optimizer.zero_grad()
        return layer.weight.float()

    rounded, nearest = after_ten_steps(True), after_ten_steps(False)
    assert float(rounded.mean()) == pytest.approx(0.99, abs=1e-3)
    assert bool((nearest == 1.0).all())


def reachable_tensors(value, through_object=False):
    """(tensor, reached through an object's attributes) for every tensor in dicts, lists, tuples and objects."""
    if isinstance(value, torch.Tensor):
        yield value, through_object
    elif isinstance(value, dict):
        for v in value.values():
            yield from reachable_tensors(v, through_object)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from reachable_tensors(v, through_object)
    elif hasattr(value, "__dict__"):
        yield from reachable_tensors(vars(value), True)


@pytest.mark.parametrize("in_backward", [False, True], ids=["one-optimizer", "per-parameter"])
@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")  # meta weights, by design
def test_a_resumed_apollo_state_lands_on_its_parameters_device(tmp_path, in_backward):
    """Checkpoints.resume puts every tensor of the optimizer state where its parameter is, projector objects'
    attributes included (torch's load_state_dict leaves objects as they are). The parameters sit on the meta
    device, standing in for a GPU: accelerate loads a one-process checkpoint to the CPU."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import get_scheduler

    from memrecipe.training.checkpoint import Checkpoints

    recipe = full("weight_dtype=fp32", "optim=apollo_adamw", "optim_args.rank=8", *(IN_BACKWARD if in_backward else []))

    def prepared(model, optimizer):
        accelerator = Accelerator(cpu=True, device_placement=False)
        model, optimizer = accelerator.prepare(model, optimizer)
        scheduler = get_scheduler("constant", optimizer)
        accelerator.register_for_checkpointing(scheduler)
        return accelerator, model, optimizer, scheduler

    try:
        model, optimizer, _ = trained(recipe, steps=2)  # step 2: the projections exist, mid-gap
        accelerator, model, optimizer, _ = prepared(model, optimizer)
        Checkpoints(accelerator, model, tmp_path).save({"step": 2, "num_processes": 1})
        AcceleratorState._reset_state(True)
        fresh, _ = loop_model(recipe, embedded_model(), "no")
        fresh.to("meta")  # the optimizer's state must follow its parameters there when it loads
        accelerator, fresh, optimizer, scheduler = prepared(fresh, make_optimizer(recipe, fresh, CPU))
        Checkpoints(accelerator, fresh, tmp_path).resume(scheduler)
    finally:
        AcceleratorState._reset_state(True)
    found = [(t, through) for state in optimizer.state.values() for t, through in reachable_tensors(state)]
    assert len(optimizer.state) == sum(1 for p in fresh.parameters())
    assert any(through for _, through in found)  # the projectors' tensors were reached too
    assert {str(t.device) for t, _ in found} == {"meta"}


def test_torchao_and_peft_say_nothing_on_import():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import memrecipe, peft, torchao.optim, apollo_torch"],
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_torchaos_step_is_compiled_before_step_one_and_leaves_the_run_as_it_was(monkeypatch):
    """On CUDA torchao compiles its step per kind of parameter; make_optimizer compiles every kind before step 1
    (compile_ahead), so that the first backward (the step in backward) compiles nothing, and the weights after the
    step equal an optimizer's that compiled inside it: the twins' steps touched no state and drew no random number
    (stochastic rounding draws). Run here with the CUDA path chosen on CPU tensors and dynamo's counting backend."""
    from torch._dynamo.testing import CompileCounter

    compiled = CompileCounter()
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": compiled}))
    recipe = full("weight_dtype=bf16", "optim=adamw_torch_8bit", "weight_decay=0.1", *IN_BACKWARD)
    as_on_cuda = SimpleNamespace(device=SimpleNamespace(type="cuda"))

    def step(ahead: bool):
        torch._dynamo.reset()
        compiled.clear()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(512, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 512),
                                    torch.nn.Linear(512, 512)).to(torch.bfloat16)
        with monkeypatch.context() as m:
            if not ahead:
                m.setattr("memrecipe.training.optimizers.compile_ahead", lambda optimizer: 0.0)
            optimizer = make_optimizer(recipe, model, as_on_cuda)
        before = compiled.frame_count
        ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(1))
        model(ids).float().square().mean().backward()  # each parameter steps in its hook
        return model, optimizer, before, compiled.frame_count - before

    model, optimizer, ahead, during = step(ahead=True)
    kinds = {(tuple(p.shape), id(p) in o.full_precision, o.param_groups[0]["weight_decay"])
             for p, o in optimizer.optimizers.items()}
    # the embedding (fp32 state), two 8-bit matrices, the norm's vectors and the biases: 7 parameters, 5 kinds
    assert ahead == len(kinds) == 5 and during == 0  # every graph compiled before step 1, none in it
    assert optimizer.compile_seconds > 0
    plain, late, none_ahead, in_step = step(ahead=False)
    assert none_ahead == 0 and in_step == len(kinds)  # (without it: compiled in the first backward)
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    for p, q in zip(optimizer.optimizers, late.optimizers):
        for key, value in optimizer.state[p].items():
            other = late.state[q][key]
            assert torch.equal(value.dequantize() if hasattr(value, "dequantize") else value,
                               other.dequantize() if hasattr(other, "dequantize") else other), key
