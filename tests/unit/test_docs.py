"""One figure per fact: the numbers the README, docs/recipes.md and `memrecipe ls` (the recipes' own lines) quote
for an 8B job are the planner's, as `memrecipe plan` prints them (with its 1 GiB allowance), and the count of
recipes that run on CPU is the recipes' own."""

import re

import pytest

from helpers import REPO
from memrecipe.planning.architecture import structure
from memrecipe.planning.planner import estimate
from memrecipe.planning.registry import load_recipe, recipe_names
from memrecipe.planning.topology import Topology

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
            "max_position_embeddings": 131072, "head_dim": 128}
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64}
JOB = ["per_device_train_batch_size=2", "max_seq_length=2048"]
LORA_JOB = [*JOB, "lora.r=8", "lora.alpha=16", "lora.dropout=0"]  # torchtune's configs: lora_dropout 0.0
GiB = 2**30


def planned(recipe, *overrides, allowance=True) -> str:
    est = estimate(load_recipe(recipe, list(overrides)), structure(LLAMA_8B), Topology(1))
    return f"{(est.total - (0 if allowance else est.overhead)) / GiB:.1f}"


def text(path) -> str:
    return " ".join((REPO / path).read_text().split())  # prose wraps anywhere


def longest(recipe, gpu, *overrides, model=LLAMA_8B) -> str:
    """'222K, activation offload, flex_attention, 55.5 GiB': plan --longest's row for the model (the 8B) on one GPU of
    `gpu` GB, with the kernel it planned (`auto`: the worst a GPU box may take there)."""
    from memrecipe.planning.ladder import longest_per_recipe, tokens

    row = longest_per_recipe(load_recipe(recipe, list(overrides)), structure(model), Topology(1), gpu * 10**9, None)
    if not row.seq_length:
        return "does not fit"
    kernel = KERNELS[row.verdict.estimate.attention]
    return f"{tokens(row.seq_length)}, {row.rung.name}, {kernel}, {row.verdict.estimate.host_total() / GiB:.1f} GiB"


KERNELS = {"flash_attention_2": "flash-attn 2", "flex_attention": "flex_attention", "sdpa": "sdpa"}
FLEX = "attn_implementation=flex_attention"


LONG_CONTEXT = [("docs/long-context.md", f"| {gpu} GB | {{}} | {{}} | {{}} | {{}} |",
                 lambda gpu=gpu: [longest("single-gpu-lora", gpu), longest("single-gpu-lora", gpu, "lora.dropout=0"),
                                  longest("qlora", gpu, "lora.r=32"), longest("qlora", gpu, "lora.r=32", "lora.dropout=0")])
                for gpu in (24, 48, 80)] + [
    ("docs/long-context.md", "With `attn_implementation=flex_attention` named, the 80 GB row reads | {} | {} | {} | {} |",
     lambda: [longest("single-gpu-lora", 80, FLEX), longest("single-gpu-lora", 80, FLEX, "lora.dropout=0"),
              longest("qlora", 80, "lora.r=32", FLEX), longest("qlora", 80, "lora.r=32", FLEX, "lora.dropout=0")])] + [
    ("docs/long-context.md", f"| 70B, {gpu} GB | {{}} | {{}} | {{}} |",
     lambda gpu=gpu: [longest("single-gpu-lora", gpu, model=LLAMA_70B), longest("qlora", gpu, "lora.r=32", model=LLAMA_70B),
                      longest("qlora", gpu, "lora.r=32", "lora.dropout=0", model=LLAMA_70B)])
    for gpu in (24, 48, 80)]


def longest_split(model, machines, *overrides, recipe="zero3-ulysses") -> str:
    """'5,891K, 1473.4 GiB': zero3-ulysses's longest sequence on `machines` x 8 x 80 GB, 2 TB of host RAM each (sp over
    all the GPUs), with the host RAM per machine there (or `recipe`'s, with its overrides)."""
    from memrecipe.planning.ladder import longest_per_recipe, tokens

    topo = Topology(8 * machines, num_machines=machines)
    row = longest_per_recipe(load_recipe(recipe, ["model_name_or_path=org/model", *overrides]), structure(model),
                             topo, 80 * 10**9, 2 * 10**12)
    return f"{tokens(row.seq_length)}, {row.verdict.estimate.host_total() / GiB:.1f} GiB" if row.seq_length else "none"


MANY_GPUS = [("docs/long-context.md", f"| {name}, {label} | {{}} | {{}} |",
              lambda model=model, machines=machines: [
                  longest_split(model, machines, "lora.r=16", "lora.target_modules=all-linear"),
                  longest_split(model, machines)])
             for name, model in (("8B", LLAMA_8B), ("70B", LLAMA_70B))
             for label, machines in (("8 x 80 GB", 1), ("2 x 8 x 80 GB", 2))]


RING = ["parallelism.cp_size=8", "packing=false"]
RING_8B = lambda: [longest_split(LLAMA_8B, 1, *RING, "lora.r=16", "lora.target_modules=all-linear",  # noqa: E731
                                 recipe="fsdp-lora"), longest_split(LLAMA_8B, 1, *RING, recipe="fsdp")]

SPLIT_8B = lambda: [longest_split(LLAMA_8B, 1, "lora.r=16", "lora.target_modules=all-linear").split(", ")[0]]  # noqa: E731
SPLIT_8B_BOTH = lambda: [longest_split(LLAMA_8B, 1).split(", ")[0], *SPLIT_8B()]  # noqa: E731  (as shipped; LoRA)


@pytest.mark.parametrize("path, sentence, figures", [*LONG_CONTEXT, *MANY_GPUS,
    ("README.md", "the 8B plans at {} tokens fully fine-tuned, as shipped, on 8 x 80 GB ({} with `lora.r=16`",
     SPLIT_8B_BOTH),
    ("docs/long-context.md", "ring attention over the 8 GPUs plans the 8B at {} with LoRA r16 on every linear layer "
                             "(`fsdp-lora`) and {} fully fine-tuned (`fsdp`)", RING_8B),
    ("docs/recipes.md", "8B plans at {} tokens with LoRA on 8 x 80 GB", SPLIT_8B),
    ("README.md", "puts LoRA on q_proj, v_proj at {} GiB and QLoRA at {} GiB",
     lambda: [planned("single-gpu-lora", *LORA_JOB, "lora.target_modules=[q_proj,v_proj]"), planned("qlora", *LORA_JOB)]),
    ("README.md", "without it these are {} and {} GiB",
     lambda: [planned("single-gpu-lora", *LORA_JOB, "lora.target_modules=[q_proj,v_proj]", allowance=False),
              planned("qlora", *LORA_JOB, allowance=False)]),
    ("README.md", "(LoRA {} GiB, QLoRA {} GiB for that job)",
     lambda: [planned("single-gpu-lora", *LORA_JOB, "lora.target_modules=[q_proj,v_proj]", "activation_offload=true"),
              planned("qlora", *LORA_JOB, "activation_offload=true")]),
    ("README.md", "plans at {} GiB (APOLLO: {})",
     lambda: [planned("single-gpu-full", *JOB), planned("single-gpu-full", *JOB, "optim=apollo_adamw")]),
    ("docs/recipes.md", "at 2 x 2048 tokens at {} GiB with this recipe", lambda: [planned("single-gpu-full", *JOB)]),
    ("docs/recipes.md", "against {} GiB for `adamw-8bit`", lambda: [planned("adamw-8bit", *JOB)]),
    ("docs/recipes.md", "then plans at {} GiB", lambda: [planned("single-gpu-full", *JOB, "optim=apollo_adamw")]),
    ("recipes/single-gpu-full.yaml", "plans at {} GiB, not {}",  # what `memrecipe ls` shows
     lambda: [planned("single-gpu-full", *JOB), planned("adamw-8bit", *JOB)]),
], ids=lambda v: v if isinstance(v, str) and "/" in v or v == "README.md" else None)
def test_quoted_figures_are_the_planners(path, sentence, figures):
    assert sentence.format(*figures()) in text(path), (path, sentence.format(*figures()))


def test_the_count_of_recipes_that_run_on_cpu_is_the_recipes_own():
    words = {9: "Nine", 10: "Ten", 11: "Eleven", 8: "Eight"}
    runs = sum(load_recipe(name).cpu_blocker is None for name in recipe_names())
    assert f"{words[runs]} recipes run end to end on CPU" in text("README.md")
    assert re.search(rf"which run end to end on CPU: {words[runs].lower()} do", text("docs/recipes.md"))
