"""topology.py: the processes a run takes, and the precision a recipe resolves to on them."""

from memrecipe.planning.configs import deepspeed_config
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology, resolve_precision


def test_mixed_precision_auto_resolves_per_machine():
    r = load_recipe("fsdp")
    assert resolve_precision(r, Topology(2, cpu=True)) == "bf16"
    assert resolve_precision(r, Topology(8, bf16=True)) == "bf16"
    assert resolve_precision(r, Topology(8, bf16=False)) == "fp16"
    assert resolve_precision(load_recipe("fsdp", ["mixed_precision=no"]), Topology(8)) == "no"
    ds = deepspeed_config(load_recipe("zero3-offload"), Topology(1, bf16=False))
    assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0 and not ds["bf16"]["enabled"]
