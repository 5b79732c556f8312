"""training/ring.py and the ring attention keys (parallelism.cp_size): torch's context_parallel through accelerate on
FSDP2, CUDA only. What runs here: the recipe's rules, the generated config through accelerate's own launcher into
its ParallelismConfig, the batch each process computes on, and the refusals on CPU. The ring kernels themselves
run on a GPU only (benchmarks/gpu_acceptance.py's 2-GPU row)."""

from types import SimpleNamespace

import pytest
import torch

from memrecipe.errors import RecipeError
from memrecipe.planning.configs import generate
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology, check_supported
from memrecipe.training.data import IGNORE
from memrecipe.training.loss import RING_SLICE, model_inputs
from memrecipe.training.ring import Ring, check_ring

RING = ["parallelism.cp_size=2", "packing=false"]


@pytest.mark.parametrize("recipe, overrides, reason", [
    ("zero3-offload", ["parallelism.cp_size=2", "packing=false"], "accelerate runs on FSDP2 only: use fsdp or fsdp-lora"),
    ("fsdp-lora", ["parallelism.cp_size=2", "fsdp.version=1", "packing=false"], "FSDP2 only"),
    ("fsdp-lora", ["parallelism.cp_size=2"], "a packed row's documents would attend to each other: set packing=false"),
    ("fsdp-lora", [*RING, "attn_implementation=eager"], "torch replaces SDPA's kernels only"),
    ("fsdp-lora", [*RING, "attn_implementation=flash_attention_2"], "set attn_implementation=sdpa"),
    ("tp", ["parallelism.cp_size=2", "packing=false"], "parallelism.tp_size=2 and parallelism.cp_size=2: one way of "
                                                       "splitting at a time"),
])
def test_what_ring_attention_cannot_run_with_is_refused_with_the_reason(recipe, overrides, reason):
    with pytest.raises(RecipeError, match=reason):
        load_recipe(recipe, overrides)


def test_a_ring_trains_with_sft_on_a_multiple_of_its_size_and_not_with_dpo():
    ring = load_recipe("fsdp-lora", RING)
    assert ring.context_parallel == 2 and ring.sequence_parallel == 1 and ring.tensor_parallel == 1
    check_supported(ring, Topology(4))  # 2 rings of 2: FSDP2 shards over all 4
    with pytest.raises(RecipeError, match="parallelism.cp_size=2 processes \\(ring attention\\): --num-processes must "
                                          "be a multiple of 2, got 3"):
        check_supported(ring, Topology(3))
    with pytest.raises(RecipeError, match="run dpo does not run ring attention"):
        load_recipe("fsdp-lora", RING, script="dpo")


def test_the_generated_config_reaches_accelerates_parallelism_config(tmp_path):
    """fsdp-lora with cp 8 on 8 GPUs, through accelerate launch's own validation and the environment its launcher gives
    every process (utils/launch.py, prepare_multi_gpu_env), is the ParallelismConfig the Accelerator builds: cp 8 on
    torch with allgather, one data-parallel shard group, FSDP2 over the flattened dp_shard x cp dimension."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import patch_environment
    from accelerate.utils.launch import prepare_multi_gpu_env

    files = generate(load_recipe("fsdp-lora", ["parallelism.cp_size=8", "packing=false"]), Topology(8))
    (name,) = [n for n in files if n.endswith(".yaml") and n.startswith("fsdp_lora")]
    (tmp_path / name).write_text(files[name])
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(
        ["--config_file", str(tmp_path / name), "sft.py"]))
    assert args.use_fsdp and args.fsdp_version == 2 and args.use_parallelism_config
    env = prepare_multi_gpu_env(args)
    with patch_environment(**{k: v for k, v in env.items() if k.startswith("PARALLELISM_CONFIG_")}):
        config = ParallelismConfig()
    assert (config.cp_size, config.cp_backend, config.cp_handler.cp_comm_strategy) == (8, "torch", "allgather")
    assert config.dp_shard_size == 1 and config.total_size == 8 and config.fsdp_dim_names == ["dp_shard_cp"]


def stand_in(cp: int, device: str = "cuda"):
    """An Accelerator's ring-facing side: accelerate's ParallelismConfig, the device, and maybe_context_parallel
    recorded (its kernels run on CUDA only)."""
    from accelerate.parallelism_config import ParallelismConfig

    calls = []

    def maybe_context_parallel(**kwargs):
        import contextlib

        calls.append(kwargs)
        return contextlib.nullcontext()

    config = ParallelismConfig(cp_size=cp, dp_shard_size=1) if cp > 1 else None
    return SimpleNamespace(parallelism_config=config, device=torch.device(device), num_processes=cp,
                           maybe_context_parallel=maybe_context_parallel, calls=calls)


def test_each_process_computes_on_the_ids_positions_and_targets_shifted_before_the_cut():
    """The ring cuts the token ids, their positions and each position's target (the labels shifted first, so the
    target of a slice's last token is the next slice's first), in place inside torch's context: from copies, so the
    window's whole batches stay whole for the loop's counts; no mask (accelerate drops it). No ring: the batch."""
    ids = torch.arange(8)[None]
    batch = {"input_ids": ids.clone(), "labels": torch.tensor([[IGNORE, IGNORE, 5, 6, 7, 8, 9, IGNORE]]),
             "attention_mask": torch.ones_like(ids), "position_ids": ids.clone()}
    accelerator = stand_in(2)
    with Ring(accelerator).shards(batch) as sliced:
        assert set(sliced) == {"input_ids", "position_ids", "shift_labels", RING_SLICE}
        assert sliced["shift_labels"].tolist() == [[IGNORE, 5, 6, 7, 8, 9, IGNORE, IGNORE]]
    (call,) = accelerator.calls
    assert [b is sliced[k] for b, k in zip(call["buffers"], ("input_ids", "position_ids", "shift_labels"))] == [True] * 3
    assert sliced[RING_SLICE] is True
    assert call["buffer_seq_dims"] == [1, 1, 1] and call["no_restore_buffers"] == set(call["buffers"])
    assert all(b is not batch[k] for b, k in zip(call["buffers"], ("input_ids", "position_ids")))
    with Ring(stand_in(1)).shards(batch) as whole:
        assert whole is batch
    assert Ring(stand_in(2)).row_multiple == 4 and Ring(stand_in(1)).row_multiple == 1  # torch cuts 2 x cp equal chunks


def test_the_worker_refuses_a_ring_on_cpu_and_a_launch_config_that_disagrees(cli):
    ring = load_recipe("fsdp-lora", RING)
    assert check_ring(stand_in(2), ring) == 2
    with pytest.raises(RecipeError, match="runs on CUDA only: torch's context_parallel replaces SDPA's CUDA kernels"):
        check_ring(stand_in(2, "cpu"), ring)
    with pytest.raises(RecipeError, match="the recipe splits each sequence over 2 process\\(es\\) by ring attention "
                                          "\\(parallelism.cp_size=2\\), the launch config over 1"):
        check_ring(stand_in(1), ring)
    done = cli("run", "sft", "--recipe", "fsdp-lora", "--num-processes", "2", *RING, "--dry-run")
    assert done.returncode == 2 and "ring attention (parallelism.cp_size) runs on CUDA only" in done.stderr


def test_a_slices_jumping_positions_get_no_square_mask():
    """A process's slice under torch's load balancer is two chunks, one from each end of the row: its positions jump
    where they meet (here 0-3 then 12-15). Given positions and no mask, transformers reads the jump as two packed
    documents and builds an [S x S] mask (a 200K-token slice: 40 GB); the loop's inputs for a ring's slice carry an
    all-ones mask, under which sdpa runs causal with no mask tensor."""
    from transformers import AutoConfig
    from transformers.masking_utils import create_causal_mask

    from memrecipe.training.loading import embedded_model

    config = AutoConfig.from_pretrained(embedded_model())
    config._attn_implementation = "sdpa"
    positions = torch.cat([torch.arange(4), torch.arange(12, 16)])[None]
    sliced = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": positions}
    embeds = torch.zeros(1, 8, config.hidden_size)

    def mask(batch):
        inputs = model_inputs(batch)
        return create_causal_mask(config, embeds, inputs.get("attention_mask"), None, position_ids=inputs["position_ids"])

    assert mask({**sliced, RING_SLICE: True}) is None
    square = mask(sliced)  # (what the same slice would cost without the mark)
    assert square is not None and square.shape[-2:] == (8, 8)
