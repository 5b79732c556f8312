"""training/probes.py: what a process really holds, read off the tensors themselves (each storage once, a tied weight
once, views and a model kept beside counted as they are held), and its peaks."""

import pytest
import torch

from memrecipe.training.probes import held_bytes


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(100, 8)
        self.head = torch.nn.Linear(8, 100, bias=False)
        self.head.weight = self.embed.weight  # one storage, two parameters' names
        self.norm = torch.nn.LayerNorm(8)


def test_each_storage_is_counted_once_and_a_model_beside_adds_its_own():
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters())
    model.head(model.norm(model.embed(torch.tensor([[1, 2]])))).sum().backward()
    optimizer.step()
    params = 100 * 8 * 4 + 2 * 8 * 4  # the tied matrix once, the norm's weight and bias
    # AdamW: two moments and a 0-d fp32 step per parameter
    assert held_bytes(model, optimizer) == {"parameters": params, "gradients": params, "optimizer_state": 2 * params + 3 * 4,
                                          "paged": 0}
    frozen = torch.nn.Linear(8, 8, bias=False).bfloat16()  # e.g. DPO's reference copy
    assert held_bytes(model, optimizer, beside=[frozen])["parameters"] == params + 8 * 8 * 2
    # a model beside that shares the policy's weights (DPO's adapters-off reference) holds nothing more
    assert held_bytes(model, optimizer, beside=[model.embed])["parameters"] == params


def test_ddps_gradient_buckets_are_held_gradients_too():
    """DDP's reducer keeps a flat copy of the gradients in its buckets (gradient_as_bucket_view off, accelerate's
    default): the held gradients are twice the .grad bytes, as the planner counts them (planning/states.py)."""
    import os

    import torch.distributed as dist

    from helpers import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(100, 100))
        model(torch.randn(4, 100)).sum().backward()
        grads = sum(p.grad.nbytes for p in model.parameters())
        assert held_bytes(model, torch.optim.SGD(model.parameters()))["gradients"] == 2 * grads
        viewed = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(100, 100), gradient_as_bucket_view=True)
        viewed(torch.randn(4, 100)).sum().backward()
        assert held_bytes(viewed, torch.optim.SGD(viewed.parameters()))["gradients"] == grads
    finally:
        dist.destroy_process_group()


def test_paged_optimizer_state_is_counted_and_said_apart():
    """bitsandbytes' paged state (CUDA managed memory, torch.frombuffer, is_paged) is optimizer state the CUDA
    allocator never sees: held bytes count it, and say it apart (`paged`) for the allocator's peak to add."""
    model = torch.nn.Linear(1000, 100)
    optimizer = torch.optim.SGD(model.parameters())
    paged = torch.zeros(100_000)
    paged.is_paged = True  # (what bitsandbytes' functional.get_paged marks; CUDA-only, so planted here)
    optimizer.state[model.weight] = {"state1": paged, "state2": torch.zeros(10)}
    held = held_bytes(model, optimizer)
    assert held["paged"] == 400_000 and held["optimizer_state"] == 400_040


def test_the_device_sampler_keeps_the_most_in_use_and_samples_nothing_off_cuda():
    from memrecipe.training.probes import DeviceSampler

    readings = iter([10, 30, 20] + [5] * 10_000)
    sampler = DeviceSampler(torch.device("cuda"), every=0.001, read=lambda: next(readings))
    import time

    time.sleep(0.05)
    assert sampler.stop() == 30
    assert DeviceSampler(torch.device("cpu")).stop() is None


def test_a_profiles_kernel_time_counts_each_kernel_once():
    """The H200's adamw-8bit profile read 'the GPU's kernels: 1.901 s (108% of the step)': every op's device time was
    summed beside its kernels' own. The kernels alone are counted (torch's "Self CUDA time total"), not the op that
    launched them nor a compiled graph's annotation."""
    from types import SimpleNamespace

    from memrecipe.training.probes import kernel_seconds

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = [SimpleNamespace(device_type=cpu, self_device_time_total=90_000, is_user_annotation=False),  # aten op
              SimpleNamespace(device_type=cuda, self_device_time_total=90_000, is_user_annotation=False),  # its kernel
              SimpleNamespace(device_type=cuda, self_device_time_total=60_000, is_user_annotation=True),  # a graph
              SimpleNamespace(device_type=cuda, self_device_time_total=10_000, is_user_annotation=False)]
    assert kernel_seconds(events) == pytest.approx(0.1)
