"""NCCL's device buffers: what each process's communicators allocate on its GPU, outside torch's allocator, the first
time a collective or an exchange uses them (NCCL_RUNTIME_CONNECT, on by default). Read off NCCL's source (2.28,
github.com/NVIDIA/nccl) for the boxes that run several GPUs of a recipe: one machine of NVSwitch-connected
H100s or H200s (NCCL's defaults, the worst of the boxes people rent: PCIe boxes open far fewer channels). A CPU has no
NCCL (gloo); the GPU row of an 8-GPU box confirms, none has run yet (docs/memory.md).
"""

from __future__ import annotations

MiB = 2**20

# One connection's buffers, by protocol (src/init.cc computeBuffSizes' defaults; the factors in src/include/device.h)
LL = 8 * 512 * 8 * 16  # NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x sizeof(ncclLLFifoLine)
LL128 = 120 * 640 * 8 * 8  # NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x NCCL_STEPS x sizeof(uint64_t)
SIMPLE = 1 << 22  # DEFAULT_BUFFSIZE
HEADER = 4096  # ncclSendMem, ncclRecvMem (src/include/comm.h: MEM_ALIGN)
GRANULE = 2 * MiB  # CUDA_IPC_MIN (src/include/comm.h): p2p.cc rounds each end's buffer up to it

# Channels on one machine of 8 NVSwitch-connected Hopper GPUs: 32 for rings and trees (NCCL's log on such a box,
# nccl issue #1685: "as many as 32 channels"), exchanges (send/recv) on all of them for each peer
# (src/graph/paths.cc: 2 x the NVLinks, 18, a peer; rounded up to a power of 2 and capped at the 32), 16 for NVLS
# (src/transport/nvls.cc: NVLS_NCHANNELS_SM90).
CHANNELS = 32
NVLS_CHANNELS = 16
NVLS_STEP = 128 * 1024  # NCCL_NVLS_CHUNKSIZE's default: each NVLS buffer is NCCL_STEPS of it
SHARED_STEPS, NET_CHUNK = 16, 128 * 1024  # src/transport/net.cc; src/init.cc NCCL_P2P_NET_CHUNKSIZE's default


def _rounded(n: int) -> int:
    return -(-n // GRANULE) * GRANULE


def connection_bytes(read: bool = False) -> int:
    """A P2P connection's device bytes, its two ends (src/transport/p2p.cc, p2pSendSetup and p2pRecvSetup): the
    receiver holds the LL and LL128 buffers and the SIMPLE one, which the sender holds instead where it reads (P2P
    read: sm80 over NVLink, src/graph/paths.cc), each end rounded up to 2 MiB: 10 + 2 MiB on Hopper, 6 + 6 on A100."""
    receiver = HEADER + LL + LL128 + (0 if read else SIMPLE)
    sender = HEADER + (SIMPLE if read else 0)
    return _rounded(receiver) + _rounded(sender)


def collectives_bytes(ranks: int, local: int) -> int:
    """Per process, a communicator of `ranks` that runs collectives (all-gather, reduce-scatter, all-reduce), each
    algorithm NCCL's tuner may pick connected on its first use (src/transport/generic.cc): a ring (per channel, a
    connection from the previous rank and one to the next: one connection's ends), a tree (up and down, both ways:
    two in the chain's middle, one where two ranks make it), and NVLS where the machine's GPUs share an NVSwitch
    (src/transport/nvls.cc: per channel two buffers of NCCL_STEPS chunks, for each of the machine's `local` GPUs)."""
    if ranks < 2:
        return 0
    tree = 2 if ranks > 2 else 1
    nvls = NVLS_CHANNELS * 2 * 8 * NVLS_STEP * local if local > 1 else 0
    return CHANNELS * (1 + tree) * connection_bytes() + nvls


def exchange_bytes(ranks: int, local: int) -> int:
    """Per process, a communicator of `ranks` (`local` of them on its machine) that runs all-to-all (send/recv to
    every peer): with each peer on the machine a connection each way on each channel a peer takes (nccl issue #1685:
    3.3 GB a GPU after the first all_to_all_single on 8 H100s), and for the peers on other machines the network's
    shared pools, one to send and one to receive (src/transport/net.cc: NCCL_SHARED_STEPS chunks of the network's
    128 KiB P2P chunk a channel)."""
    if ranks < 2:
        return 0
    remote = 2 * CHANNELS * SHARED_STEPS * NET_CHUNK if ranks > local else 0
    return (min(ranks, local) - 1) * CHANNELS * connection_bytes() + remote


def communicators(processes: int, machines: int, sp: int = 1, cp: int = 1, tp: int = 1) -> list[tuple[str, int]]:
    """The communicators a process of a recipe's run opens, each (what, its bytes on this process's GPU): the
    world's (accelerate's reductions; DDP's, FSDP's and ZeRO's collectives), and those of the parallel groups, each
    torch's own process group: Ulysses' group (all-to-all) and DeepSpeed's sequence-data-parallel group, where ZeRO
    runs beside it (deepspeed/runtime/sequence_parallel/parallel_state_sp.py), ring attention's group (its keys and
    values all-gathered) and FSDP2's shard group of the device mesh, tensor parallelism's and its data-parallel
    group."""
    if processes < 2:
        return []
    local = processes // machines
    out = [("the world's collectives", collectives_bytes(processes, local))]
    if sp > 1:
        out += [("Ulysses' all-to-all", exchange_bytes(sp, min(sp, local))),
                ("ZeRO's sequence-data-parallel collectives", collectives_bytes(processes, local))]
    if cp > 1:
        out += [("ring attention's all-gathers", collectives_bytes(cp, min(cp, local))),
                ("FSDP2's shards over the mesh", collectives_bytes(processes, local))]
    if tp > 1:
        out += [("tensor parallelism's collectives", collectives_bytes(tp, min(tp, local)))]
        if processes // tp > 1:
            out += [("data parallelism's over the mesh", collectives_bytes(processes // tp, max(1, local // tp)))]
    return out


def nccl_bytes(processes: int, machines: int, sp: int = 1, cp: int = 1, tp: int = 1) -> int:
    """Per process, every communicator's buffers on its GPU (communicators)."""
    return sum(b for _, b in communicators(processes, machines, sp, cp, tp))
