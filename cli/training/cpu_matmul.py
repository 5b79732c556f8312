"""bf16 matmuls on a CPU without a bf16 GEMM (AVX2 only: AMD Zen 1-3, most Intel desktops).

torch runs a bf16 matmul on the CPU through oneDNN only where the CPU has AVX-512 (or AVX-NE-CONVERT); elsewhere
`cpublas::gemm` falls to `gemm_stub`, a scalar triple loop (aten/src/ATen/native/cpu/BlasKernel.cpp), and the
non-transposed case, every linear layer's input gradient, runs at ~1 GFLOP/s: a smoke-test step ~15x slower than on
an AVX-512 CPU (pytorch/pytorch#146508). Here bf16 mm/addmm/bmm/baddbmm compute as that kernel and oneDNN do, bf16
inputs with fp32 accumulation rounded once to bf16, but through the fp32 GEMM (MKL).

Memory: the fp32 copies live in buffers numpy allocates, outside torch's allocator, so the bytes torch counts (the
profiler's, the planner's CPU measurements) are the native kernel's, the bf16 output alone. Other dtypes run the
native kernels (the `.out` forms, which this leaves registered)."""

from __future__ import annotations

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


def _untracked(like: torch.Tensor) -> torch.Tensor:
    """An empty fp32 tensor of `like`'s shape whose memory numpy allocated (torch's allocator never sees it)."""
    return torch.from_numpy(np.empty(tuple(like.shape), dtype=np.float32))


def _matmul(op, *args, **kwargs):
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    out_shape = _shape(op, args)
    out_dtype = tensors[-1].dtype
    out = torch.empty(out_shape, dtype=out_dtype)  # what the native kernel allocates
    if not all(t.dtype == torch.bfloat16 for t in tensors):
        return getattr(torch.ops.aten, op).out(*args, **kwargs, out=out)
    wide = []
    for a in args:
        if isinstance(a, torch.Tensor):
            copy = _untracked(a)
            copy.copy_(a)  # (exact: every bf16 is an fp32)
            wide.append(copy)
        else:
            wide.append(a)
    result = _untracked(out)
    getattr(torch.ops.aten, op).out(*wide, **kwargs, out=result)
    return out.copy_(result)  # rounded to nearest even, once


def _shape(op, args) -> tuple:
    if op == "mm":
        return args[0].shape[0], args[1].shape[1]
    if op == "bmm":
        return args[0].shape[0], args[0].shape[1], args[1].shape[2]
    first, second = args[1], args[2]  # addmm / baddbmm: (self, mat1, mat2)
    return (*first.shape[:-1], second.shape[-1])
