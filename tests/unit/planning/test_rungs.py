"""planning/rungs.py: the activation ladder as one table. Each rung has all its parts: the words that climb to it
make a recipe that stands on it (rung_of), uses it (`on`) and names it among its techniques (`memrecipe ls`), and
docs/long-context.md describes it."""

from pathlib import Path

from memrecipe.planning.ladder import climbs, rung_of
from memrecipe.planning.recipe import techniques
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.rungs import LADDER
from memrecipe.planning.topology import Topology

DOCS = Path(__file__).parents[3] / "docs" / "long-context.md"


def test_every_rung_is_climbed_to_stood_on_and_named():
    bottom = load_recipe("ddp", ["gradient_checkpointing=false", "per_device_train_batch_size=1"])
    assert rung_of(bottom, 1) == LADDER[0].name
    topo = Topology(2)
    below = load_recipe("zero3-offload", ["per_device_train_batch_size=1"])  # (ZeRO-3 takes sequence parallelism)
    reached = {rung.name: climbed for rung, climbed in climbs(bottom)} | {
        rung.name: climbed for rung, climbed in climbs(below, topo)}
    text = DOCS.read_text().lower()
    for technique in LADDER[1:]:
        recipe = reached[technique.name]  # a rung no recipe can climb to is missing its words or its rules
        assert rung_of(recipe, topo.num_processes) == technique.name and technique.on(recipe, 2), technique.name
        said = technique.said(recipe)
        assert said is None or said in techniques(recipe), technique.name
        assert technique.name.lower() in text, technique.name
    named = {technique.name for technique in LADDER if technique.said(reached.get(technique.name, bottom))}
    assert named == {t.name for t in LADDER} - {"no checkpointing", "sequence parallelism"}  # (Ulysses: its own words)


def test_the_rungs_are_climbed_in_the_tables_order():
    names = [rung.name for rung, _ in climbs(load_recipe("ddp", ["gradient_checkpointing=false"]), Topology(1))]
    order = [technique.name for technique in LADDER]
    assert names == sorted(names, key=order.index) and len(names) >= 5


def reached_by(name):
    """A function of planning/activations.py and every one it calls there, transitively (read off its source)."""
    import ast
    import inspect

    from memrecipe.planning import activations

    tree = ast.parse(inspect.getsource(activations))
    bodies = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in bodies:
            continue
        seen.add(current)
        todo += [n.func.id for n in ast.walk(bodies[current]) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    return seen


def test_every_rung_has_all_its_parts():
    """Its planner term is one the plan counts (activation_bytes reaches it), its loop hook a module of
    memrecipe.training with an apply (or why none is needed), and its words in the start-up line when a run stands
    on it (the facts a run reads off its model)."""
    import importlib

    from memrecipe.training.facts import SetupFacts

    counted = reached_by("activation_bytes")
    on_every_rung = SetupFacts(gradient_checkpointing=True, tiled_mlps=2, lean_norms=5, sequence_parallel=2,
                               query_chunk=16384)
    top = load_recipe("zero3-ulysses", ["activation_offload=true", "lean_norms=true", "tiled_mlp=true"])
    for technique in LADDER:
        assert technique.term in counted, technique.name
        if technique.hook:
            assert callable(importlib.import_module(f"memrecipe.training.{technique.hook}").apply), technique.name
        else:
            assert technique.why, technique.name
        stands_on = SetupFacts() if technique is LADDER[0] else on_every_rung
        if technique.name == "selective checkpointing":
            stands_on = SetupFacts(gradient_checkpointing="selective")
        assert technique.phrase(stands_on, top if technique is not LADDER[0] else bottom_recipe()), technique.name


def bottom_recipe():
    return load_recipe("ddp", ["gradient_checkpointing=false"])


def test_each_rungs_rules_are_the_recipes():
    """rules.py runs every rung's own check: a recipe that breaks one is refused with its message."""
    import pytest

    from memrecipe.errors import RecipeError

    for words, message in ((["tiled_mlp=true", "torch_compile=true"], "tiled_mlp gives each weight its gradient"),
                           (["lean_norms=true", "torch_compile=true"], "lean_norms replaces each RMSNorm"),
                           (["activation_offload=true", "gradient_checkpointing=false"], "activation_offload works with"),
                           (["query_chunks=true"], "query_chunks runs sdpa's kernel .*: set attn_implementation=sdpa"),
                           (["query_chunks=true", "attn_implementation=sdpa"], "carries one under sdpa: set packing=false"),
                           (["query_chunks=true", "attn_implementation=sdpa", "packing=false", "torch_compile=true"],
                            "query_chunks calls the kernel once a chunk"),
                           (["query_chunks=true", "attn_implementation=sdpa", "packing=false", "parallelism.cp_size=2"],
                            "ring attention passes each process a slice of the keys: set query_chunks=false")):
        with pytest.raises(RecipeError, match=message):
            load_recipe("single-gpu-lora" if "parallelism.cp_size=2" not in words else "fsdp-lora", words)
    # under Ulysses the chunks run inside its attention (tests/runs/test_sequence_parallel.py)
    assert load_recipe("zero3-ulysses", ["query_chunks=true", "attn_implementation=sdpa", "parallelism.sp_size=2"]
                       ).query_chunks is True
