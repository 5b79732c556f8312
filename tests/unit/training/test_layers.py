"""training/layers.py: what is done to the model's layers. activation_offload: each checkpointed layer's saved input
waits in host memory, the gradients do not change, and the planner moves those bytes from the device to the host;
torch_compile: each decoder layer compiled in place gives the eager losses, with checkpointing and LoRA."""

from types import SimpleNamespace

import pytest
import torch

from helpers import loop_model
from memrecipe.errors import RecipeError
from memrecipe.planning.architecture import read_config, structure
from memrecipe.planning.planner import estimate
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology
from memrecipe.training.data import Collator
from memrecipe.training.loading import embedded_model
from memrecipe.training.loss import count_targets, fuse_head, lm_loss, token_loss
from memrecipe.training.optimizers import make_optimizer

B, S = 2, 40


def step(offload):
    """One forward/backward of single-gpu-lora (no dropout, so both runs see the same function)."""
    recipe = load_recipe("single-gpu-lora", ["lora.dropout=0", f"activation_offload={str(offload).lower()}"])
    torch.manual_seed(0)
    model, hooks = loop_model(recipe, embedded_model(), "bf16")
    if hooks is not None:  # copy to a separate host tensor, as on CUDA: else on CPU both runs hold one tensor
        hooks.copy_on_cpu = True
    ids = torch.randint(0, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = token_loss(model(input_ids=ids).logits, ids)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return hooks, grads, model.config


def test_offload_moves_one_input_per_checkpointed_layer_and_keeps_the_gradients():
    hooks, grads, config = step(offload=True)
    none, plain, _ = step(offload=False)
    assert none is None
    # each decoder layer's checkpoint saves its input (bf16 hidden states) and nothing else
    assert hooks.tensors == hooks.copied == config.num_hidden_layers  # each parked in a copy of its own
    assert hooks.bytes == config.num_hidden_layers * B * S * config.hidden_size * 2
    assert grads.keys() == plain.keys() and len(grads) > 0
    for name in grads:
        torch.testing.assert_close(grads[name], plain[name], rtol=0, atol=0)  # the same tensors, only parked elsewhere


def test_offload_needs_gradient_checkpointing():
    from memrecipe.errors import RecipeError

    with pytest.raises(RecipeError, match="gradient_checkpointing=true"):
        load_recipe("ddp", ["activation_offload=true"])


def test_planner_moves_the_checkpointed_inputs_to_the_host():
    s = structure(read_config(None) | {"num_hidden_layers": 16})
    gpu = Topology(1)
    on = estimate(load_recipe("qlora", ["activation_offload=true"]), s, gpu)
    off = estimate(load_recipe("qlora"), s, gpu)
    b, seq = off.micro_batch, off.seq_length
    inputs = 16 * b * seq * s.hidden * 2  # the bf16 residual stream (unquantized weights stay 16-bit)
    back = 2 * b * seq * s.hidden * 2  # the input its layer's recompute uses, and the next one, prefetched
    assert off.activations - on.activations == inputs - back
    assert on.host_offload - off.host_offload == inputs


class RecordedStreams:
    """CopyStreams' stand-in on CPU: the copies run at once, each call is logged, events finish when told."""

    def __init__(self):
        self.log, self.finished = [], set()
        self.device = torch.device("cpu")  # the device whose tensors go to the host (CopyStreams': a CUDA device)

    def side_waits_compute(self):
        self.log.append("side waits compute")

    def on_side(self):
        import contextlib

        self.log.append("side")
        return contextlib.nullcontext()

    def record(self):
        self.log.append(f"event {len(self.log)}")
        return self.log[-1]

    def compute_waits(self, event):
        self.log.append(f"compute waits {event}")

    def used_by_compute(self, tensor):
        self.log.append("used by compute")

    def done(self, event):
        return event in self.finished

    def finish(self):
        self.log.append("finish")


def test_the_side_stream_copies_keep_their_order_and_the_gradients():
    """The CUDA path's order of issue, wait and keep-alive, with recorded streams: forward's copies wait for the
    compute stream and keep their device tensor until their event is done; backward waits on a tensor's own event
    before it is used and issues the previous layer's copy (the prefetch) right after; the gradients are exact."""
    _, plain, _ = step(offload=False)
    recipe = load_recipe("single-gpu-lora", ["lora.dropout=0", "activation_offload=true"])
    torch.manual_seed(0)
    model, hooks = loop_model(recipe, embedded_model(), "bf16")
    streams = hooks.streams = RecordedStreams()
    unpack = hooks.unpack_hook  # each unpack marked in the log: a prefetched tensor's copy comes before it
    hooks.unpack_hook = lambda packed: streams.log.append("unpack") or unpack(packed)
    ids = torch.randint(0, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = token_loss(model(input_ids=ids).logits, ids)
    layers = model.config.num_hidden_layers
    forward = list(streams.log)
    assert forward == ["side waits compute", "side", "event 2"] + [
        entry for k in range(1, layers) for entry in ("side waits compute", "side", f"event {3 * k + 2}")]
    kept = [tensor for tensor, _ in hooks.alive.values()]  # no copy done yet: every device tensor kept alive
    assert len(kept) == layers and all(torch.is_tensor(t) and t.shape == (B, S, model.config.hidden_size) for t in kept)
    streams.finished.update(e for e in forward if e.startswith("event"))
    loss.backward()
    backward = streams.log[len(forward):]
    last = f"event {3 * layers - 1}"  # the last layer's tensor: fetched on demand, then each prefetches the one before
    assert backward[:5] == ["unpack", "side", f"event {len(forward) + 2}", f"compute waits event {len(forward) + 2}",
                            "used by compute"] and last in forward
    unpacks = [i for i, e in enumerate(backward) if e == "unpack"]
    waits = [i for i, e in enumerate(backward) if e.startswith("compute waits")]
    assert len(waits) == len(unpacks) == layers == hooks.copied
    for unpack, wait in list(zip(unpacks, waits))[1:]:  # every tensor but the first was fetched before backward asked
        assert backward.index(backward[wait].removeprefix("compute waits ")) < unpack, backward
    assert not hooks.alive and not hooks.host and not hooks.back  # copies done: nothing kept on the device
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, plain[name], rtol=0, atol=0)


def test_a_tensor_off_the_streams_device_stays_where_it_is():
    """A CUDA layer can save a host tensor beside its device tensors (the first GPU run's offloaded rows did, and
    died in record_stream): only the streams' device's tensors take the side-stream path; another passes through
    unmoved, uncounted, with no stream call."""
    from memrecipe.training.layers import HostOffload

    hooks = HostOffload()
    hooks.streams = streams = RecordedStreams()
    elsewhere, here = torch.ones(3, device="meta"), torch.ones(4)
    packed = hooks.pack_hook(elsewhere)
    assert hooks.unpack_hook(packed) is elsewhere and streams.log == [] and hooks.tensors == hooks.bytes == 0
    streams.finished.add("event 2")
    back = hooks.unpack_hook(hooks.pack_hook(here))
    assert torch.equal(back, here) and back is not here and hooks.copied == 1 and hooks.bytes == 16


def losses(compiled: bool, steps: int = 4) -> tuple[list[float], object]:
    recipe = load_recipe("single-gpu-lora", ["mixed_precision=no", "lora.dropout=0.0",
                                             f"torch_compile={str(compiled).lower()}"])
    assert recipe.gradient_checkpointing
    torch.manual_seed(0)
    model, _ = loop_model(recipe, embedded_model(), "no")
    fuse_head(model)  # as the loop does: the head stays eager, outside the compiled layers
    optimizer = make_optimizer(recipe, model, SimpleNamespace(device=torch.device("cpu")))
    collate = Collator(0, 64)
    generator, out = torch.Generator().manual_seed(1), []
    model.train()
    for _ in range(steps):  # rows of different lengths, padded to 64: one shape, one graph
        rows = [torch.randint(4, 500, (int(n),), generator=generator).tolist()
                for n in torch.randint(20, 60, (2,), generator=generator)]
        batch = collate([{"input_ids": r, "labels": r} for r in rows])
        assert batch["input_ids"].shape[1] == 64
        loss = lm_loss(model, batch) / count_targets(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    return out, model


@pytest.mark.slow
def test_compiled_layers_train_to_the_eager_losses():
    import torch._dynamo.utils

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # (process-wide: an earlier test's compile, e.g. flex_attention's, counts)
    eager, _ = losses(compiled=False)
    compiled, model = losses(compiled=True)
    assert compiled == pytest.approx(eager, abs=1e-4) and eager[-1] != eager[0]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one graph serves every layer and step
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert len(layers) == 4 and all(m._compiled_call_impl is not None for m in layers)
    assert not any("_orig_mod" in name for name in model.state_dict())  # saved and resumed under its own names


def test_compile_is_refused_where_it_is_not_supported(monkeypatch):
    from memrecipe.training.accelerator import make_accelerator

    with pytest.raises(RecipeError, match="torch_compile is not supported under FSDP"):
        load_recipe("fsdp-lora", ["torch_compile=true"])
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")  # a user's accelerate config with dynamo_config
    with pytest.raises(RecipeError, match="remove dynamo_config and set torch_compile: true"):
        make_accelerator(load_recipe("single-gpu-lora"))


def test_the_recompute_runs_each_layer_to_its_end_never_stopping_inside_the_tiled_mlp():
    """Non-reentrant checkpointing stops a recompute early by raising from its saved-tensor hook at the layer's last
    save; on the top rung that save is the tiled MLP's, inside its autograd Function, and torch 2.11 on CUDA lost the
    exception there (SystemError at the first backward: the first GPU run of the rung, docs/gpu.md). The loop's
    checkpoints run each layer's recompute to its end: every tiled MLP's call returns twice per step (the forward and
    the recompute; an early stop raises out of the recompute's)."""
    recipe = load_recipe("single-gpu-lora", ["lora.dropout=0", "activation_offload=true", "lean_norms=true",
                                             "tiled_mlp=4"])
    torch.manual_seed(0)
    model, hooks = loop_model(recipe, embedded_model(), "bf16")
    layers = model.base_model.model.model.layers
    completed = []
    for layer in layers:
        layer.mlp.register_forward_hook(lambda module, args, out: completed.append(module))
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        token_loss(model(input_ids=ids).logits, ids).backward()
    assert [completed.count(layer.mlp) for layer in layers] == [2] * len(layers)  # the forward, and the recompute


def test_the_host_copies_live_in_one_block_of_the_bytes_they_hold():
    """The CUDA path's host memory (HostArena), with recorded streams: the first forward's copies are pageable tensors
    of their own; from the next on, each is a slice of one block of exactly the bytes a forward saves (torch's pinned
    allocator would round each layer's up to a power of two); a longer batch grows it. The gradients are exact."""
    _, plain, _ = step(offload=False)
    recipe = load_recipe("single-gpu-lora", ["lora.dropout=0", "activation_offload=true"])
    torch.manual_seed(0)
    model, hooks = loop_model(recipe, embedded_model(), "bf16")
    hooks.streams = RecordedStreams()
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    model.train()

    def backward(length, seed=1):
        ids = torch.randint(0, model.config.vocab_size, (B, length), generator=torch.Generator().manual_seed(seed))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = token_loss(model(input_ids=ids).logits, ids)
        in_block = [host.untyped_storage().data_ptr() == hooks.arena.block.untyped_storage().data_ptr()
                    if hooks.arena.block is not None else False for _, host in hooks.host.values()]
        model.zero_grad()
        loss.backward()
        return in_block

    def exact(length):  # what a forward saves: each layer's bf16 input, its slice aligned
        return layers * -(-B * length * hidden * 2 // 512) * 512

    assert backward(S) == [False] * layers and hooks.arena.size == 0  # the first forward: pageable copies
    assert backward(S) == [True] * layers and hooks.arena.size == exact(S)  # not layers x a power of two
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, plain[name], rtol=0, atol=0)
    assert backward(2 * S) == [True] * (layers // 2) + [False] * (layers - layers // 2)  # longer: the rest pageable
    assert backward(2 * S) == [True] * layers and hooks.arena.size == exact(2 * S)
    assert backward(S) == [True] * layers and hooks.arena.size == exact(2 * S)  # a shorter one fits as it is
    assert "finish" in hooks.streams.log  # the copies reading the old block ran before it was let go
