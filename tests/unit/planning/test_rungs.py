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
