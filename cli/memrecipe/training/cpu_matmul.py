"""bf16 matmuls on a CPU without a bf16 GEMM (AVX2 only: AMD Zen 1-3, most Intel desktops).

torch runs a bf16 matmul on the CPU through oneDNN only where the CPU has AVX-512 (or AVX-NE-CONVERT); elsewhere
`cpublas::gemm` falls to `gemm_stub`, a scalar triple loop (aten/src/ATen/native/cpu/BlasKernel.cpp), and the
non-transposed case, every linear layer's input gradient, runs at ~1 GFLOP/s: a smoke-test step ~15x slower than on
an AVX-512 CPU (pytorch/pytorch#146508). Here bf16 mm/addmm/bmm/baddbmm compute as that kernel and oneDNN do, bf16
inputs with fp32 accumulation rounded once to bf16, but through numpy's fp32 GEMM (its OpenBLAS, one thread:
memrecipe/__init__.py).

Memory: the fp32 copies are numpy's, outside torch's allocator, so the bytes torch counts (the profiler's, the
planner's CPU measurements) are the native kernel's, the bf16 output alone, allocated by the same op. Other dtypes
run torch's kernels (the `.out` forms, left registered)."""

from __future__ import annotations

import ctypes
import functools
import warnings

import numpy as np
import torch

_OPS = ("mm", "addmm", "bmm", "baddbmm")


def bf16_gemm_native() -> bool:
    """Whether torch's own bf16 matmul on this CPU is oneDNN's (the gate of mkldnn_bf16_gemm in CPUBlas.cpp)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


_LIBRARIES: list = []  # (a Library's registrations last as long as the object)


def bf16_matmuls_in_fp32() -> bool:
    """Compute this process's bf16 CPU matmuls through fp32 GEMMs where torch has no bf16 GEMM for the CPU; whether
    they do. For runs in bf16 on the CPU (make_accelerator): every CPU matmul then passes through Python first."""
    if not _LIBRARIES and not bf16_gemm_native():
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # ("Overriding a previously registered kernel": that is the point)
            warnings.simplefilter("ignore", UserWarning)
            for op in _OPS:
                library.impl(op, functools.partial(_matmul, op), "CPU")
        _LIBRARIES.append(library)
    return active()


def active() -> bool:
    """Whether this process's bf16 CPU matmuls run through fp32 GEMMs."""
    return bool(_LIBRARIES)


def _bits(t: torch.Tensor) -> np.ndarray:
    """numpy's view of a 2-byte tensor's memory, by address: Tensor.numpy() would mark the storage unresizable for
    good, and FSDP2 frees each gathered weight by resizing its storage to 0."""
    if t.numel() == 0:
        return np.empty(tuple(t.shape), dtype=np.uint16)
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    memory = memoryview((ctypes.c_uint16 * extent).from_address(t.data_ptr()))
    return np.ndarray(tuple(t.shape), dtype=np.uint16, buffer=memory, strides=[2 * s for s in t.stride()])


def _wide(t: torch.Tensor) -> np.ndarray:
    """A bf16 tensor's values as numpy's float32 (exact: a bf16 is an fp32's upper half)."""
    return (_bits(t).astype(np.uint32) << 16).view(np.float32)


def _narrow(x: np.ndarray) -> torch.Tensor:
    """float32 -> a new bf16 tensor, rounded to nearest even as torch rounds (NaN stays a quiet NaN). torch allocates
    it (the op's one allocation, as its own kernel's) and numpy writes it: no tensor over numpy's memory, which the
    profiler's memory timeline would take for one of torch's blocks at the same address."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    rounded[np.isnan(x)] = 0x7FC0
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    _bits(out)[...] = rounded
    return out


def _matmul(op, *args, beta=1, alpha=1):
    """aten's mm / addmm / bmm / baddbmm on the CPU. Every operand bf16: computed in numpy (its fp32 GEMM, its
    buffers), only the bf16 result made by torch; otherwise torch's own kernel (its `.out` form)."""
    if not all(a.dtype == torch.bfloat16 for a in args):
        scale = {} if op in ("mm", "bmm") else {"beta": beta, "alpha": alpha}
        first, second = args[-2:]
        shape = (*first.shape[:-1], second.shape[-1])
        return getattr(torch.ops.aten, op).out(*args, **scale, out=torch.empty(shape, dtype=second.dtype))
    *added, first, second = args
    product = np.matmul(_wide(first), _wide(second))
    if added:  # addmm / baddbmm: beta x self + alpha x the product, summed in fp32 and rounded once
        if alpha != 1:
            product *= np.float32(alpha)
        if beta != 0:  # (beta 0 ignores self, NaN included, as torch does)
            product += np.float32(beta) * _wide(added[0])
    return _narrow(product)
