"""training/facts.py: the setup read off the live objects, one typed record: what the allocator applied, read off its
segments; report.json's "setup" read back, an older memrecipe's included; the start-up line's words for each rung."""

import torch

from memrecipe.planning.registry import load_recipe
from memrecipe.training.facts import SetupFacts


def test_the_allocators_expandable_segments_are_read_off_its_segments(monkeypatch):
    """What the CUDA allocator applied, not the environment variable: its segments say (planted snapshots here)."""
    from types import SimpleNamespace

    from memrecipe.training import facts

    cuda = SimpleNamespace(type="cuda")
    for segments, applied in (([{"is_expandable": True}], True), ([{"is_expandable": False}], False), ([], None)):
        monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda segments=segments: segments)
        assert facts._expandable_segments(cuda) is applied
    assert facts._expandable_segments(torch.device("cpu")) is None


def test_a_reports_setup_reads_back_whatever_memrecipe_wrote_it():
    facts = SetupFacts(engine="DeepSpeed", zero_stage=3, optimizer_state_dtypes=["float32"])
    assert SetupFacts.from_dict(facts.to_dict()) == facts
    older = {"engine": "DDP", "params": 10, "a_key_since_removed": 1}  # an older report lacks keys, or has others
    assert SetupFacts.from_dict(older) == SetupFacts(engine="DDP", params=10)


def test_the_start_up_line_says_each_rung_the_run_stands_on():
    """Each rung's phrase (planning/rungs.py) from the facts read off the model: what the loop applied, not the recipe."""
    offload = load_recipe("single-gpu-lora", ["activation_offload=true", "lean_norms=true", "tiled_mlp=true"])
    said = SetupFacts(gradient_checkpointing=True, tiled_mlps=4, lean_norms=9, lora_shared_inputs=28).activations(offload)
    assert said == ("full checkpointing (each layer keeps its input); their inputs in host RAM; 9 RMSNorms keep their "
                    "inputs, not fp32 copies; 4 MLPs run in tiles of tokens, recomputed in backward; 28 LoRA layers' "
                    "adapters share their inputs")
    plain = load_recipe("ddp", ["gradient_checkpointing=false"])
    assert SetupFacts().activations(plain) == "every one kept"
    assert SetupFacts(engine_checkpointed_layers=4).activations(plain).startswith("full checkpointing by the engine's")
    lean = load_recipe("single-gpu-lora", ["lean_norms=true"])  # asked, but no Llama RMSNorm in the model: said
    assert "none of this model's norms is Llama's RMSNorm" in SetupFacts(gradient_checkpointing=True).activations(lean)
