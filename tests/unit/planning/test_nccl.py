"""NCCL's buffers, which sit outside torch's allocator and which no CPU run can show (gloo): the planner's arithmetic
read off NCCL's source (planning/nccl.py), against what NCCL logs and a published measurement, and the plan that
carries it (a GPU's overhead beside the allocator's; nothing on one process or on CPU)."""

import pytest

from memrecipe.planning.architecture import structure
from memrecipe.planning.nccl import (GRANULE, HEADER, LL, LL128, SIMPLE, collectives_bytes, communicators,
                                     connection_bytes, exchange_bytes)
from memrecipe.planning.planner import GPU_OVERHEAD, estimate
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology
from model_configs import LLAMA_8B

MiB = 2**20


def test_a_connections_ends_are_the_allocations_nccl_logs():
    """On Hopper the receiver of a P2P connection allocates 10,485,760 bytes and the sender 2,097,152: the two sizes
    NCCL_DEBUG_SUBSYS=ALLOC logs on 8 H100s (nccl issue #1685); A100's P2P read moves SIMPLE to the sender."""
    assert (LL, LL128, SIMPLE) == (524_288, 4_915_200, 4_194_304)  # src/init.cc's defaults
    receiver, sender = HEADER + LL + LL128 + SIMPLE, HEADER
    assert -(-receiver // GRANULE) * GRANULE == 10_485_760 and -(-sender // GRANULE) * GRANULE == 2_097_152
    assert connection_bytes() == 12 * MiB == connection_bytes(read=True)  # 6 + 6 MiB on A100


def test_an_all_to_all_on_8_gpus_is_the_published_measurement_less_what_nccl_holds_beside_it():
    """nccl issue #1685: a GPU's memory outside PyTorch grew from 1.06 to 4.34 GB with the first all_to_all_single on
    8 H100s (32 channels a peer). The connections' buffers are 0.86x of that growth (the rest: NCCL's own work
    queues and host-mapped structures, not counted); never above it."""
    grown = 4.34e9 - 1.06e9
    assert 0.8 < exchange_bytes(8, 8) / grown < 1.0
    assert exchange_bytes(1, 1) == 0 and exchange_bytes(2, 2) == 32 * 12 * MiB
    assert exchange_bytes(16, 8) == exchange_bytes(8, 8) + 2 * 32 * 16 * 128 * 1024  # the network's pools, not 8 more


def test_collectives_connect_a_ring_a_tree_and_nvls():
    assert collectives_bytes(1, 1) == 0
    assert collectives_bytes(2, 2) == 32 * 2 * 12 * MiB + 16 * 2 * MiB * 2  # a two-rank tree: one peer both ways
    assert collectives_bytes(8, 8) == 32 * 3 * 12 * MiB + 16 * 2 * MiB * 8  # 1,152 + 256 MiB
    assert collectives_bytes(16, 1) == 32 * 3 * 12 * MiB  # one GPU a machine: no NVSwitch between them


@pytest.mark.parametrize("processes, sp, cp, tp, groups", [
    (1, 1, 1, 1, []),
    (8, 1, 1, 1, ["the world's collectives"]),
    (8, 8, 1, 1, ["the world's collectives", "Ulysses' all-to-all", "ZeRO's sequence-data-parallel collectives"]),
    (8, 1, 8, 1, ["the world's collectives", "ring attention's all-gathers", "FSDP2's shards over the mesh"]),
    (4, 1, 1, 2, ["the world's collectives", "tensor parallelism's collectives", "data parallelism's over the mesh"]),
])
def test_each_parallel_group_is_a_communicator_of_its_own(processes, sp, cp, tp, groups):
    assert [name for name, _ in communicators(processes, 1, sp, cp, tp)] == groups


def test_the_plan_carries_ncclS_buffers_beside_the_allocators_on_several_gpus_only():
    s = structure(LLAMA_8B)
    ulysses = load_recipe("zero3-ulysses", ["model_name_or_path=org/model", "max_seq_length=65536"])
    eight = estimate(ulysses, s, Topology(8))
    assert eight.nccl == 2 * collectives_bytes(8, 8) + exchange_bytes(8, 8)  # 5,504 MiB
    assert eight.overhead == GPU_OVERHEAD + eight.nccl and eight.as_dict()["nccl"] == eight.nccl
    assert any("NCCL's buffers: 5.4 GiB" in note for note in eight.notes)
    one = estimate(load_recipe("zero3-ulysses", ["model_name_or_path=org/model", "max_seq_length=65536",
                                                  "parallelism.sp_size=1"]), s, Topology(1))
    assert one.nccl == 0 and one.overhead == GPU_OVERHEAD
    fsdp = estimate(load_recipe("fsdp", []), s, Topology(2))
    assert fsdp.nccl == collectives_bytes(2, 2) and fsdp.total - fsdp.model_states - fsdp.working == fsdp.overhead
    assert estimate(load_recipe("fsdp", []), s, Topology(2, cpu=True)).nccl == 0  # gloo
