"""memrecipe: memory-saving fine-tuning recipes for Hugging Face Accelerate.

The CLI lives in memrecipe.main; the loop scripts (recipes/sft.py, recipes/dpo.py) import what they use from
memrecipe.loop. Importing this package imports no torch. It is the one place that sets process-wide state: the
logging levels and warning filters below, and environment variables that torch reads once, when it is first imported
(so this runs first: the loop imports memrecipe before torch, and `memrecipe run`'s launch inherits the variables).
"""

import logging
import os
import warnings

__version__ = "0.1.0"

# Library notices that say nothing about a run: bitsandbytes' optional CPU 4-bit kernel, a
# peft/transformers deprecation, and torch's rename of collectives that DeepSpeed still calls.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
# ... which on an AVX512-BF16 CPU it asks of the hub at import, through the kernels package (which says it cannot
# check the publisher offline); the loop loads every model with use_kernels=False, so nothing else asks it.
logging.getLogger("kernels").setLevel(logging.ERROR)
# torchao (the adamw_torch_8bit optimizer; peft imports it too once installed): its CUDA-only kernels
# do not load on a machine without them, and its enums use a torch.compile registration torch deprecates.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*does not implement _stable_hash_for_caching.*", category=UserWarning)
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated.*", category=FutureWarning)
# The profiler (the loss's memory is measured with it on CPU) announces every start and stop, and
# torch's C++ log says it cannot see blocks allocated before it started. Read when torch is first
# imported (the loop imports memrecipe first); set either variable to see those lines again.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # above its highest level (5, USDT)
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
# The CUDA caching allocator grows its segments in place unless the user configured it (torch 2.13 reads
# PYTORCH_ALLOC_CONF and the older PYTORCH_CUDA_ALLOC_CONF): fragmentation is the usual cause of an
# out-of-memory at a planned 90% (single-gpu-full allocates ~17 GiB of optimizer state inside its first
# backward, between the activations). Set here, before torch is imported: in the loop (however it was
# launched) and in `memrecipe run`, whose launch inherits it. No effect without CUDA; report.json's setup says it.
# With it the host allocator keeps pinned blocks above PINNED_CACHE_MB at their size and frees them when freed, where
# it rounds every pinned block up to a power of two and caches it: DeepSpeed's offload pins its flat buffers through
# it (planning/states.py: the 70B's flat 17.6 GB gradient buffer would take 32 GiB), and frees each parameter's first pinned
# partition once moved into them.
ALLOCATOR_CONF = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
PINNED_CACHE_MB = 64
if not set(ALLOCATOR_CONF) & set(os.environ):
    os.environ["PYTORCH_ALLOC_CONF"] = f"expandable_segments:True,pinned_max_cached_size_mb:{PINNED_CACHE_MB}"
# numpy's BLAS computes the bf16 matmuls of a CPU without a bf16 GEMM (training/cpu_matmul.py) on the calling thread:
# its own pool would spin beside torch's threads on the same cores (a step 3.5x slower measured on 2 cores). Read
# when numpy is first imported; only numpy's OpenBLAS reads it (torch's matmuls are MKL's, threaded by torch).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
