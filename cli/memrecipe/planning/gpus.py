"""The GPUs people rent, by name: what CUDA shows of each one's memory (what a plan must fit in: an "80GB" H100 shows
79.2 GiB, not 80e9 bytes), its dense bf16 peak, its memory bandwidth, its host link and its link to the machine's other
GPUs (the step-time forecast's rates: planning.forecast). `--gpu NAME` reads it; `--gpu-memory` stays for anything
else."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RecipeError, did_you_mean

MiB = 2**20


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: int  # bytes: torch.cuda.get_device_properties(...).total_memory
    memory_source: str  # where that figure comes from
    bf16_flops: float  # dense (no sparsity) bf16 tensor-core peak, FLOP/s, NVIDIA's datasheet
    bandwidth: float  # device memory, bytes/s, NVIDIA's datasheet
    host_link: float  # to host memory, bytes/s one way: PCIe Gen5 x16 64 GB/s, Gen4 x16 32 GB/s
    interconnect: float  # to another GPU of the machine, bytes/s one way: NVLink's, or the PCIe link where none


# nvidia-smi's memory.total for the boxes not leased: CUDA shows about 480 MiB less (the H100 measured: 85,017,493,504
# bytes of nvidia-smi's 81,559 MiB), so a plan at these figures is up to 0.5 GiB optimistic; each entry says which.
SMI = "nvidia-smi memory.total (CUDA shows ~0.5 GiB less)"
GPUS = {gpu.name: gpu for gpu in (
    Gpu("H100", 85_017_493_504, "measured: CUDA's total_memory on a leased H100 80GB HBM3 (SXM)", 989e12, 3.35e12,
        64e9, 450e9),
    Gpu("H100-PCIe", 81_559 * MiB, SMI, 756e12, 2.0e12, 64e9, 64e9),
    Gpu("H100-NVL", 95_830 * MiB, SMI, 835e12, 3.9e12, 64e9, 300e9),
    Gpu("H200", 143_771 * MiB, "nvidia-smi memory.total on a leased H200 (CUDA shows ~0.5 GiB less)", 989e12, 4.8e12,
        64e9, 450e9),
    Gpu("A100-80GB", 81_920 * MiB, SMI, 312e12, 2.039e12, 32e9, 300e9),
    Gpu("A100-40GB", 40_960 * MiB, SMI, 312e12, 1.555e12, 32e9, 300e9),
    Gpu("L40S", 46_068 * MiB, SMI, 362e12, 0.864e12, 32e9, 32e9),
    Gpu("A10G", 23_028 * MiB, SMI, 70e12, 0.6e12, 32e9, 32e9),
    Gpu("RTX-4090", 24_564 * MiB, SMI, 165e12, 1.008e12, 32e9, 32e9),
    Gpu("RTX-3090", 24_576 * MiB, SMI, 71e12, 0.936e12, 32e9, 32e9),
)}
ALIASES = {"h100sxm": "H100", "a100": "A100-80GB", "4090": "RTX-4090", "3090": "RTX-3090"}


def _key(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def gpu_named(name: str) -> Gpu:
    """The table's GPU for a name as people write it (case, spaces and dashes aside: `h100`, `A100 40GB`,
    `rtx4090`); a one-line error naming the known ones otherwise."""
    known = {_key(n): gpu for n, gpu in GPUS.items()} | {alias: GPUS[g] for alias, g in ALIASES.items()}
    if _key(name) in known:
        return known[_key(name)]
    raise RecipeError(f"--gpu {name} is not in memrecipe's GPU table{did_you_mean(name, list(GPUS))}: one of "
                      f"{', '.join(GPUS)}, or give --gpu-memory (e.g. 80GB)")


def gpu_for_device(device_name: str | None) -> Gpu | None:
    """The table's GPU for a CUDA device name (`torch.cuda.get_device_name`: "NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-40GB"), or None for one not in it."""
    key = _key(device_name or "")
    for words, name in ((("h100", "pcie"), "H100-PCIe"), (("h100", "nvl"), "H100-NVL"), (("h100",), "H100"),
                        (("h200",), "H200"), (("a100", "40gb"), "A100-40GB"), (("a100",), "A100-80GB"),
                        (("l40s",), "L40S"), (("a10g",), "A10G"), (("4090",), "RTX-4090"), (("3090",), "RTX-3090")):
        if all(word in key for word in words):
            return GPUS[name]
    return None
