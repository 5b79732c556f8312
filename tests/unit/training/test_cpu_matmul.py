"""bf16 matmuls through fp32 GEMMs (training/cpu_matmul.py): torch's own results to a bf16 rounding, the same bytes
allocated where torch counts them, gradients through autocast; installed here whether or not this CPU has a bf16 GEMM."""

import contextlib

import pytest
import torch

from memrecipe.training import cpu_matmul


@pytest.fixture
def installed(monkeypatch):
    before = cpu_matmul.active()
    monkeypatch.setattr(cpu_matmul, "bf16_gemm_native", lambda: False)
    assert cpu_matmul.bf16_matmuls_in_fp32()
    yield
    if not before:  # (an AVX-512 machine: the rest of this process runs torch's kernels, as it did)
        cpu_matmul._LIBRARIES.pop()._destroy()


@contextlib.contextmanager
def torchs_own_kernels():
    """torch's kernels for a while, as a CPU without a bf16 GEMM runs them (oneDNN off: on a CPU with one, AVX-512
    BF16 or AMX, torch's bf16 matmul is oneDNN's, which allocates scratch buffers of its own), then the fp32 GEMMs
    again."""
    libraries = list(cpu_matmul._LIBRARIES)
    cpu_matmul._LIBRARIES.clear()
    for library in libraries:
        library._destroy()
    try:
        with torch.backends.mkldnn.flags(enabled=False):
            yield
    finally:
        assert cpu_matmul.bf16_matmuls_in_fp32()


def native(op, *args, **kwargs):
    """torch's kernel itself: the `.out` forms stay registered."""
    shape = {"mm": lambda: (args[0].shape[0], args[1].shape[1]),
             "bmm": lambda: (*args[0].shape[:2], args[1].shape[2])}.get(op, lambda: (*args[1].shape[:-1], args[2].shape[-1]))()
    return getattr(torch.ops.aten, op).out(*args, **kwargs, out=torch.empty(shape, dtype=args[-1].dtype))


def bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


CASES = {
    "mm": lambda: ("mm", bf16(48, 80, seed=0), bf16(80, 56, seed=1)),
    "mm, both transposed views": lambda: ("mm", bf16(80, 48, seed=0).t(), bf16(56, 80, seed=1).t()),
    "addmm, beta and alpha": lambda: ("addmm", bf16(56, seed=2), bf16(48, 80, seed=0), bf16(80, 56, seed=1)),
    "bmm": lambda: ("bmm", bf16(3, 40, 24, seed=0), bf16(3, 24, 32, seed=1)),
    "baddbmm": lambda: ("baddbmm", bf16(3, 40, 32, seed=2), bf16(3, 40, 24, seed=0), bf16(3, 24, 32, seed=1)),
}


@pytest.mark.parametrize("case", CASES)
def test_bf16_matmuls_equal_torchs_own_to_a_rounding(installed, case):
    op, *args = CASES[case]()
    kwargs = {"beta": 0.5, "alpha": 2.0} if op in ("addmm", "baddbmm") else {}
    got, expected = getattr(torch, op)(*args, **kwargs), native(op, *args, **kwargs)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    # both accumulate in fp32 and round once: only a different summation order can move a result by one bf16 step
    assert (got == expected).float().mean() > 0.99
    torch.testing.assert_close(got, expected, rtol=2 ** -7, atol=1e-6)


def test_other_dtypes_run_torchs_kernels(installed):
    a, b = torch.randn(32, 48, dtype=torch.float64), torch.randn(48, 16, dtype=torch.float64)
    assert torch.equal(a @ b, native("mm", a, b))


def test_torch_counts_the_bf16_output_alone(installed):
    """The fp32 copies are numpy's: the CPU profiler (the planner's CPU measurements) sees what the native kernel
    allocates, its output."""
    a, b = bf16(256, 512, seed=0), bf16(512, 128, seed=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        out = a @ b
    allocated = sum(max(event.self_cpu_memory_usage, 0) for event in profile.events())
    assert allocated == out.numel() * out.element_size() == 256 * 128 * 2


def test_gradients_through_autocast_match_fp32(installed):
    """A linear layer under CPU autocast, forward and backward (mm for the input's gradient, the slow case of
    torch's fallback): as fp32 to bf16's precision."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(16, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().pow(2).sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    reference = torch.nn.functional.linear(x_ref, layer.weight.detach(), layer.bias.detach())
    reference.pow(2).sum().backward()
    torch.testing.assert_close(y.float(), reference, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=5e-2, atol=5e-2)


def test_the_profilers_memory_timeline_is_the_native_kernels(installed):
    """The planner's CPU measurements read the profiler's memory timeline (tests/measuring.py): a bf16 step through
    these kernels allocates what torch's own do, the same sizes in the same order, and the timeline's peak is the
    same (a tensor over numpy's memory would be taken for a torch block freed at that address)."""
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    torch.manual_seed(0)
    layer, x, w = torch.nn.Linear(256, 128), torch.randn(64, 256, requires_grad=True), torch.randn(128, 32)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x) @ w
        y.float().sum().backward()

    def profiled():
        step()  # (the gradients exist before the profiled step, as in a run's later steps)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                    record_shapes=True, with_stack=True) as profile:
            step()
        events = list(profile.profiler.kineto_results.experimental_event_tree())
        sizes = []
        while events:
            event = events.pop(0)
            events = list(event.children) + events
            if event.tag == _EventType.Allocation:
                sizes.append(event.extra_fields.alloc_size)
        _, timeline = MemoryProfileTimeline(profile._memory_profile())._coalesce_timeline("cpu")
        return sizes, max(sum(held) for held in timeline)

    with torchs_own_kernels():
        expected = profiled()
    assert profiled() == expected


def test_the_operands_storages_stay_resizable(installed):
    """FSDP2 frees each gathered weight by resizing its storage to 0 after its layer (free_storage): reading an
    operand through Tensor.numpy() marked its storage unresizable for good, and every FSDP run on CPU crashed."""
    weight, x = bf16(64, 32, seed=0), bf16(8, 64, seed=1)
    out = x @ weight[:, 3:20]  # (a view with an offset and strides of its own)
    torch.testing.assert_close(out, native("mm", x, weight[:, 3:20]), rtol=2 ** -7, atol=1e-6)
    for tensor in (weight, x, out):
        tensor.untyped_storage().resize_(0)
