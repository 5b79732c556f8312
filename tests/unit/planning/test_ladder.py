"""planning/ladder.py: the activation ladder's rungs as the words that climb to them (each accepted by the recipe's
rules), the longest sequence a recipe fits, and the cheapest rung that fits at a length."""

import pytest

from memrecipe.planning.architecture import structure
from memrecipe.planning.attention import offset_limit
from memrecipe.planning.ladder import STEP, climb, climbs, longest, longest_per_recipe, rungs, tokens, with_words
from memrecipe.planning.planner import estimate, judge
from memrecipe.planning.registry import load_recipe, recipe_names
from memrecipe.planning.topology import Topology
from memrecipe.units import GiB
from model_configs import LLAMA_8B

GPU80 = 80 * 10**9


def test_each_rung_is_words_the_recipes_rules_accept_and_climbing_keeps_fewer_activations_on_the_gpu():
    s = structure(LLAMA_8B)
    for name in recipe_names():
        recipe = load_recipe(name, ["max_seq_length=32768", "per_device_train_batch_size=1"])
        ladder = rungs(recipe)
        if recipe.sequence_parallel != 1:  # zero3-ulysses: split already; its sdpa in chunks above
            assert [(rung.name, rung.words) for rung in ladder] == [("sequence parallelism", ()), (
                "query chunks", ("query_chunks=true",))], name
            continue
        names = [rung.name for rung in ladder]
        assert ladder[0].words == () and names[-1] in ("activation offload", "lean norms", "tiled MLP", "query chunks"), name
        tiles = recipe.distributed_type != "fsdp" and not recipe.optimizer_in_backward and not recipe.torch_compile
        assert ("tiled MLP" in names) == tiles, name
        assert (names[-1] == "query chunks") == (not recipe.torch_compile and recipe.attn_implementation == "auto"
                                                 and recipe.tensor_parallel == 1), name
        assert ("lean norms" in [rung.name for rung in ladder]) == (not recipe.lean_norms and not recipe.torch_compile
                                                                and recipe.tensor_parallel == 1)
        on_gpu = [estimate(with_words(recipe, rung.words), s, Topology(8)).activations for rung in ladder]
        assert on_gpu == sorted(on_gpu, reverse=True) and (on_gpu[-1] < on_gpu[0] or len(ladder) == 1), (name, on_gpu)
    fsdp = rungs(load_recipe("fsdp"))[-1].words  # FSDP's own checkpoint wrapper gives way to the loop's; no tiles
    assert fsdp == ("gradient_checkpointing=true", "fsdp.activation_checkpointing=false", "activation_offload=true",
                    "lean_norms=true", "attn_implementation=sdpa", "packing=false", "query_chunks=true")


def test_the_longest_sequence_fits_and_one_k_more_does_not():
    recipe = load_recipe("single-gpu-lora", ["per_device_train_batch_size=1", "activation_offload=true"])
    s, gpu = structure(LLAMA_8B), Topology(1)
    length, verdict = longest(recipe, s, gpu, GPU80, None)
    assert length % STEP == 0 and verdict.fits and verdict.estimate.seq_length == length
    assert not judge(estimate(recipe, s, gpu, micro_batch=1, seq_length=length + STEP), GPU80, None).fits
    assert longest(recipe, s, gpu, 1 * GiB, None) == (0, None)  # the model alone does not fit


def test_a_recipe_reaches_furthest_on_its_highest_rung_and_the_host_ram_can_bind():
    s = structure(LLAMA_8B)
    lora = longest_per_recipe(load_recipe("single-gpu-lora"), s, Topology(1), GPU80, None)
    assert lora.rung.name == "query chunks"
    assert lora.rung.words == ("activation_offload=true", "lean_norms=true", "tiled_mlp=true",
                               "attn_implementation=sdpa", "packing=false", "query_chunks=true")
    assert lora.recipe.per_device_train_batch_size == 1 and lora.seq_length > 128 * STEP
    tight = longest_per_recipe(load_recipe("single-gpu-lora"), s, Topology(1), GPU80, 32 * GiB)
    assert tight.seq_length < lora.seq_length and tight.verdict.estimate.host_total() <= 32 * GiB


@pytest.mark.parametrize("recipe, length, rung", [("single-gpu-lora", 131072, "activation offload"),
                                                   ("qlora", 131072, "activation offload"),
                                                   ("qlora", 65536, "full checkpointing")])  # as written
def test_the_cheapest_rung_that_fits_is_taken(recipe, length, rung):
    s = structure(LLAMA_8B)
    r = load_recipe(recipe, [f"max_seq_length={length}", "per_device_train_batch_size=1"])
    climbed, taken, fits = climb(r, s, Topology(1), GPU80, None)
    assert fits and taken.name == rung and judge(estimate(climbed, s, Topology(1)), GPU80, None).fits
    closest, at, fits = climb(r, s, Topology(1), 10 * GiB, None)  # nothing fits: the rung that comes closest
    assert not fits and at.name == "query chunks" and estimate(closest, s, Topology(1)).total == min(
        estimate(c, s, Topology(1)).total for _, c in climbs(r, Topology(1)))


def test_lengths_read_as_people_write_them():
    assert (tokens(131072), tokens(512 * 1024), tokens(4 * 1024 * 1024), tokens(500)) == ("128K", "512K", "4,096K", "500")


def test_a_recipe_without_checkpointing_climbs_through_selective_then_full_checkpointing():
    names = [rung.name for rung in rungs(load_recipe("ddp", ["gradient_checkpointing=false"]))]
    assert names == ["no checkpointing", "selective checkpointing", "full checkpointing", "activation offload",
                     "lean norms", "tiled MLP", "query chunks"]
    selective = rungs(load_recipe("single-gpu-lora", ["gradient_checkpointing=selective"]))
    assert [(r.name, r.words) for r in selective] == [
        ("selective checkpointing", ()), ("full checkpointing", ("gradient_checkpointing=true",)),
        ("activation offload", ("gradient_checkpointing=true", "activation_offload=true")),
        ("lean norms", ("gradient_checkpointing=true", "activation_offload=true", "lean_norms=true")),
        ("tiled MLP", ("gradient_checkpointing=true", "activation_offload=true", "lean_norms=true", "tiled_mlp=true")),
        ("query chunks", ("gradient_checkpointing=true", "activation_offload=true", "lean_norms=true", "tiled_mlp=true",
                          "attn_implementation=sdpa", "packing=false", "query_chunks=true"))]


def test_on_several_gpus_the_ladder_climbs_on_to_sequence_parallelism():
    """After the tiled MLP, a ZeRO-3 recipe on N GPUs splits each sequence over them (one example per row, as Ulysses
    needs under sdpa), then runs that sdpa in query chunks inside Ulysses' attention: the 8B's longest LoRA sequence
    on 8 x 80 GB grows past ALST's 3.7M tokens and past where sdpa's backward stops unchunked (its 32-bit offsets:
    2^31 / (4 heads a GPU x 128), where the split alone stopped), short of the 8 x one GPU's length the memory would
    hold, with its dropout redrawn (NCCL's buffers beside it: planning.nccl); peft's dropout kept stops it short of
    that; a recipe on one GPU, or off ZeRO-3, has no split."""
    s = structure(LLAMA_8B)
    lora = ["lora.r=16", "lora.target_modules=all-linear"]
    eight = longest_per_recipe(load_recipe("zero3-offload", lora), s, Topology(8), GPU80, 2 * 10**12)
    assert eight.rung.name == "query chunks" and eight.seq_length > offset_limit(4, 128)
    assert eight.rung.words[-4:] == ("packing=false", "parallelism.sp_size=8", "attn_implementation=sdpa",
                                     "query_chunks=true")
    one = with_words(load_recipe("zero3-offload", lora), ["per_device_train_batch_size=1"])
    split = dict((rung.name, climbed) for rung, climbed in climbs(one, Topology(8)))["sequence parallelism"]
    assert longest(split, s, Topology(8), GPU80, 2 * 10**12)[0] == offset_limit(4, 128)
    kept = longest_per_recipe(load_recipe("zero3-offload", [*lora, "lora.redraw_dropout=false"]), s, Topology(8),
                              GPU80, 2 * 10**12)
    assert 3.7e6 < kept.seq_length < eight.seq_length
    unsplit = longest_per_recipe(load_recipe("zero3-offload", [*lora, "parallelism.sp_size=1"]), s, Topology(1), GPU80,
                                 2 * 10**12)
    assert unsplit.rung.name == "query chunks" and 8 * unsplit.seq_length > eight.seq_length
    assert "sequence parallelism" not in [r.name for r, _ in climbs(load_recipe("fsdp-lora"), Topology(8))]
