"""Ulysses on the loop's side (training/sequence.py), without a launch: each target counted once over a sequence's
slices, rows cut into equal slices, gloo's gathers evened out without changing the loss, a resumed epoch's slices,
the heads a group can split. The launched runs: tests/runs/test_sequence_parallel.py."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from helpers import tiny_model
from memrecipe.errors import RecipeError
from memrecipe.planning.topology import check_heads
from memrecipe.training import sequence
from memrecipe.training.data import IGNORE, Collator
from memrecipe.training.loss import count_targets, lm_loss, next_tokens
from memrecipe.training.sequence import EvenLengths, SequenceShards


def labels_row():
    labels = torch.arange(100, 116)[None]
    labels[:, :3] = IGNORE  # a prompt
    return labels


def test_a_slice_keeps_the_target_at_its_boundary():
    """Shifted before the cut (DeepSpeed's adapter: shift_labels), the slices' targets are the whole row's, each once:
    the first slice's last token predicts the second slice's first. Shifted after the cut, that target is lost."""
    labels = labels_row()
    shifted = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]  # ulysses_sp.py, UlyssesSPDataLoaderAdapter.refill
    slices = [{"shift_labels": part} for part in shifted.chunk(2, dim=1)]
    assert torch.equal(torch.cat([next_tokens(s) for s in slices], dim=1), next_tokens({"labels": labels}))
    assert sum(count_targets(s) for s in slices) == count_targets({"labels": labels}) == 13
    after = sum(count_targets({"labels": part}) for part in labels.chunk(2, dim=1))
    assert after == count_targets({"labels": labels}) - 1  # the boundary's target, dropped


def test_rows_are_cut_into_equal_slices_each_with_its_positions():
    examples = [{"input_ids": list(range(5, 12)), "labels": list(range(5, 12))},
                {"input_ids": list(range(5, 9)), "labels": list(range(5, 9))}]
    batch = Collator(0, sequence_parallel=4)(examples)
    assert batch["input_ids"].shape == (2, 8) and torch.equal(batch["position_ids"], torch.arange(8).expand(2, 8))
    assert Collator(0, 64, sequence_parallel=6)(examples)["input_ids"].shape[1] == math.lcm(64, 6)
    assert "position_ids" not in Collator(0)(examples)  # one process: as before


def test_gloo_gathers_even_lengths_and_the_loss_is_unchanged(monkeypatch):
    """Padded to the group's longest (after every real token, no target), a batch's loss and targets are the same."""
    def longest_is(width):
        def all_reduce(tensor, op=None, group=None):
            tensor.fill_(max(int(tensor), width))
        return all_reduce

    model = tiny_model().eval()
    torch.manual_seed(0)
    examples = [{"input_ids": torch.randint(4, 64, (n,)).tolist()} for n in (9, 6)]
    for ex in examples:
        ex["labels"] = [IGNORE, IGNORE, *ex["input_ids"][2:]]
    batch = Collator(0, sequence_parallel=2)(examples)
    monkeypatch.setattr(torch.distributed, "all_reduce", longest_is(14))
    (even,) = list(EvenLengths([batch], group=None))
    assert even["input_ids"].shape == (2, 14) and torch.equal(even["position_ids"][0], torch.arange(14))
    with torch.no_grad():
        assert torch.allclose(lm_loss(model, even), lm_loss(model, batch), rtol=1e-6)
    assert count_targets(even) == count_targets(batch)


def test_a_resumed_epoch_skips_whole_draws_in_the_loader_and_the_rest_in_slices(monkeypatch):
    """Micro batch i of a process is slice r of the group's i-th draw: resumed after `consumed` micro batches, the
    loader skips consumed // sp draws and the adapter's first consumed % sp slices are dropped."""
    sp, draws = 2, [f"batch{i}" for i in range(4)]

    def adapter(loader, model):  # each draw: sp batches (one per process), this process's slice of each
        loader = list(loader)
        for i in range(0, len(loader) - 1, sp):
            for drawn in loader[i:i + sp]:
                yield {"slice_of": drawn}

    accelerator = SimpleNamespace(parallelism_config=SimpleNamespace(sp_size=sp, sp_backend="deepspeed"),
                                  device=torch.device("cpu"), deepspeed_ulysses_dl_adapter=adapter,
                                  skip_first_batches=lambda loader, n: loader[n * sp:])
    monkeypatch.setattr("deepspeed.utils.groups._get_sequence_parallel_group", lambda: None)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group: "nccl")
    shards = SequenceShards(draws, accelerator, model=None)
    assert len(shards) == 8
    whole = [b["slice_of"] for b in shards]
    for consumed in range(5):
        assert [b["slice_of"] for b in sequence.skip_batches(accelerator, shards, consumed)] == whole[consumed:]


@pytest.mark.parametrize("sp, heads, kv, fits", [
    (2, 4, 2, True), (4, 4, 2, True),  # the embedded model: 4 query heads, 2 key/value heads (replicated at sp 4)
    (8, 32, 8, True), (16, 32, 8, True), (3, 32, 8, False), (64, 32, 8, False),  # Llama-3.1-8B
    (8, 64, 8, True), (6, 12, 4, False)])
def test_a_group_splits_the_heads_or_is_refused_naming_the_sizes_that_would(sp, heads, kv, fits):
    if fits:
        check_heads(sp, heads, kv)
        return
    with pytest.raises(RecipeError, match=rf"parallelism.sp_size={sp} must divide the model's {heads} attention "
                                          rf"heads.*use sp_size \d"):
        check_heads(sp, heads, kv)


def test_the_launch_config_and_the_recipe_must_agree_on_the_group():
    from memrecipe.planning.registry import load_recipe
    from memrecipe.training.sequence import check_sequence_parallel

    def accelerator(sp, processes, engine="DEEPSPEED"):
        config = SimpleNamespace(sp_size=sp, sp_backend="deepspeed") if sp > 1 else None
        return SimpleNamespace(parallelism_config=config, num_processes=processes,
                               distributed_type=SimpleNamespace(value=engine))

    model_config = tiny_model().config
    ulysses = load_recipe("zero3-ulysses")  # sp_size null: all the processes
    assert check_sequence_parallel(accelerator(2, 2), ulysses, model_config) == 2
    assert check_sequence_parallel(accelerator(1, 1), ulysses, model_config) == 1
    with pytest.raises(RecipeError, match=r"over 2 process\(es\) \(parallelism.sp_size=null: all of them\), the "
                                          "launch config over 1"):
        check_sequence_parallel(accelerator(1, 2), ulysses, model_config)
    with pytest.raises(RecipeError, match="parallelism.sp_size=3 must divide the model's 4 attention heads"):
        check_sequence_parallel(accelerator(3, 3), load_recipe("zero3-ulysses", ["parallelism.sp_size=3"]),
                                model_config)


def test_the_generated_config_reaches_accelerates_parallelism_config(tmp_path):
    """The zero3-ulysses YAML for 8 GPUs, through accelerate launch's own validation and the environment its DeepSpeed
    launcher gives every process (utils/launch.py, prepare_deepspeed_cmd_env), is the ParallelismConfig the Accelerator
    builds: sp 8 on DeepSpeed with sdpa, one data-parallel group (DeepSpeed's train_batch_size: micro x accumulation
    x processes / sp). Its JSON is DeepSpeed's own config class's."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import patch_environment
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    from memrecipe.planning.configs import generate
    from memrecipe.planning.registry import load_recipe
    from memrecipe.planning.topology import Topology, decide

    recipe = decide(load_recipe("zero3-ulysses"), Topology(8))
    files = generate(recipe, Topology(8), folder=str(tmp_path))
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (yaml_name,) = [name for name in files if name.endswith(".yaml")]
    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(
        ["--config_file", str(tmp_path / yaml_name), "sft.py"]))
    assert args.use_deepspeed and args.use_parallelism_config
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # (as launch_command sets it)
    _, env = prepare_deepspeed_cmd_env(args)
    with patch_environment(**{k: v for k, v in env.items() if k.startswith("PARALLELISM_CONFIG_")}):
        config = ParallelismConfig()
    assert (config.sp_size, config.sp_backend, config.sp_handler.sp_attn_implementation) == (8, "deepspeed", "sdpa")
    assert config.sp_handler.sp_seq_length_is_variable and config.data_parallel_size == 1
    from deepspeed.runtime.config import DeepSpeedConfig

    (json_name,) = [name for name in files if name.endswith(".json")]
    assert DeepSpeedConfig(str(tmp_path / json_name)).zero_optimization_stage == 3


def test_ulysses_under_sdpa_is_refused_where_it_would_drop_a_sliding_window():
    """DeepSpeed's Ulysses wrapper drops the attention mask, and transformers' sdpa reads a sliding window only from
    it: past its window a Mistral's layers would attend to every key before them, silently another model. The loop
    refuses that in one line (a copied script; the plan refuses it before launch), not below the window, nor under
    flash-attn or the query chunks, which take the window from the layer."""
    from transformers import MistralConfig

    from memrecipe.planning.architecture import structure
    from memrecipe.planning.planner import estimate
    from memrecipe.planning.registry import load_recipe
    from memrecipe.planning.topology import Topology
    from memrecipe.training.sequence import check_sequence_parallel
    from model_configs import LLAMA_8B

    group = SimpleNamespace(parallelism_config=SimpleNamespace(sp_size=2, sp_backend="deepspeed"), num_processes=2,
                            distributed_type=SimpleNamespace(value="DEEPSPEED"))
    config = MistralConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=2, vocab_size=100, sliding_window=128)
    config._attn_implementation = "sdpa"
    long, short = (load_recipe("zero3-ulysses", [f"max_seq_length={n}"]) for n in (2048, 64))
    with pytest.raises(RecipeError, match=r"Ulysses drops the attention mask, and under sdpa mistral's sliding-window "
                                          r"layers would attend to every key before them, not the last 128: use "
                                          r"query_chunks=true or \(CUDA\) attn_implementation=flash_attention_2"):
        check_sequence_parallel(group, long, config)
    assert check_sequence_parallel(group, short, config) == 2
    assert check_sequence_parallel(group, load_recipe("zero3-ulysses", ["max_seq_length=2048", "query_chunks=true"]),
                                   config) == 2
    config._attn_implementation = "flash_attention_2"
    assert check_sequence_parallel(group, long, config) == 2
    mistral = structure(LLAMA_8B | {"model_type": "mistral", "sliding_window": 4096})
    words = ["model_name_or_path=org/model", "per_device_train_batch_size=1"]
    for kernel, seq, refused in (("sdpa", 32768, True), ("sdpa", 2048, False), ("flash_attention_2", 32768, False),
                                 ("sdpa query_chunks=4096", 32768, False)):
        e = estimate(load_recipe("zero3-ulysses", [*words, *f"attn_implementation={kernel}".split()]), mistral,
                     Topology(8), seq_length=seq)
        assert bool(e.refused and "not the last 4,096" in e.refused) == refused, (kernel, seq, e.refused)
