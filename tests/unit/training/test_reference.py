"""training/reference.py: DPO's frozen copy of the initial model, on one process: loaded as the policy is, its head
fused, no gradients, in eval mode, computing what the policy computed before its first step. Sharded (FSDP2) and
partitioned (ZeRO-3) copies train in tests/runs/test_dpo_run.py."""

import pytest
import torch
from accelerate.state import AcceleratorState

from helpers import loop_model
from memrecipe.planning.registry import load_recipe
from memrecipe.training.accelerator import make_accelerator
from memrecipe.training.loading import embedded_model
from memrecipe.training.reference import frozen_copy


@pytest.fixture
def accelerator():
    AcceleratorState._reset_state(True)
    yield make_accelerator(load_recipe("single-gpu-full"), mixed_precision="bf16")
    AcceleratorState._reset_state(True)


def test_the_copy_is_frozen_and_computes_what_the_policy_computes_before_a_step(accelerator):
    recipe = load_recipe("single-gpu-full", ["dpo.precompute_ref_log_probs=false"], script="dpo")
    copy = frozen_copy(recipe, embedded_model(), accelerator)
    policy, _ = loop_model(recipe, embedded_model(), "bf16")
    assert not any(p.requires_grad for p in copy.parameters()) and not copy.training
    assert {p.dtype for p in copy.parameters()} == {p.dtype for p in policy.parameters()}
    assert type(copy.lm_head) is type(policy.lm_head)  # fused as the policy's, by the recipe's chunk
    ids = torch.randint(0, copy.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), accelerator.autocast():
        mine = copy.model(input_ids=ids).last_hidden_state
        theirs = policy.model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), policy.state_dict().values()))
