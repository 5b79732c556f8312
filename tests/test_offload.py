"""activation_offload: each checkpointed layer's saved input waits in host memory, the gradients
do not change, and the planner moves those bytes from the device to the host."""

import pytest
import torch

from helpers import loop_model
from memrecipe.planning.architecture import read_config, structure
from memrecipe.training.loss import token_loss
from memrecipe.training.modeling import embedded_model
from memrecipe.planning.planner import estimate
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology

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
    one_back = b * seq * s.hidden * 2  # the input coming back for its layer's recompute
    assert off.activations - on.activations == inputs - one_back
    assert on.host_offload - off.host_offload == inputs
    assert on.speed_cost > off.speed_cost
