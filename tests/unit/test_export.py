"""export.py: a run's final save or one of its checkpoints becomes a standalone Hugging Face model folder holding
exactly those weights, in the dtype asked for; what cannot be exported is one line and writes nothing."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from memrecipe.errors import RecipeError
from memrecipe.export import export
from memrecipe.layout import STATE
from memrecipe.planning.registry import load_recipe
from memrecipe.training.loading import embedded_model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished full fine-tune's folder as the loop leaves it: recipe, final/, and checkpoint step-1 (another
    state of the weights)."""
    folder = tmp_path_factory.mktemp("run")
    base = embedded_model()
    recipe = load_recipe("single-gpu-full", [f"model_name_or_path={base}"])
    (folder / "recipe.yaml").write_text(recipe.to_yaml())
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    model.save_pretrained(folder / "final")
    AutoTokenizer.from_pretrained(base).save_pretrained(folder / "final")
    step = folder / "checkpoints" / "step-1"
    step.mkdir(parents=True)
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.005)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
               or not model.config.tie_word_embeddings}, step / "model.safetensors")
    (step / STATE).write_text(json.dumps({"step": 1}))
    return folder


def weights(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


def test_the_final_save_and_a_checkpoint_export_their_own_weights(run, tmp_path):
    final = weights(export(run, tmp_path / "final"))
    step = weights(export(run, tmp_path / "step", checkpoint="step-1", dtype="bf16"))
    expected = weights(run / "final")
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    # the checkpoint is 0.005 under the final weights, rounded to bf16
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.allclose(step[name], (expected[name] - 0.005).bfloat16().float())
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "step").dtype == torch.bfloat16
    assert json.loads((tmp_path / "step" / "memrecipe_export.json").read_text())["source"] == "step-1"


def test_a_path_inside_the_run_exports_what_it_names(run, tmp_path):
    """The path a user sees (RUN/checkpoints/step-N, RUN/final) exports as the run folder with --checkpoint would."""
    by_path = weights(export(run / "checkpoints" / "step-1", tmp_path / "by-path"))
    by_name = weights(export(run, tmp_path / "by-name", checkpoint="step-1"))
    assert by_path.keys() == by_name.keys() and all(torch.equal(by_path[k], by_name[k]) for k in by_name)
    assert not torch.equal(by_path["model.norm.weight"], weights(run / "final")["model.norm.weight"])
    record = json.loads((tmp_path / "by-path" / "memrecipe_export.json").read_text())
    assert (record["run"], record["source"]) == (str(run.resolve()), "step-1")
    final = weights(export(run / "final", tmp_path / "final"))
    assert all(torch.equal(final[k], v) for k, v in weights(run / "final").items())


@pytest.mark.parametrize("words, reason", [
    ({"checkpoint": "step-9"}, "has no complete checkpoint step-9; it has: step-1"),
    ({"merge": True}, "is a full fine-tune: there is no adapter to --merge"),
    ({"inside": "checkpoints/step-1", "checkpoint": "step-9"}, "is checkpoint step-1 of run .*--checkpoint says step-9"),
    ({"inside": "final", "checkpoint": "step-1"}, "is the final save of run .*--checkpoint says step-1"),
])
def test_what_cannot_be_exported_is_one_line_and_writes_nothing(run, tmp_path, words, reason):
    words = dict(words)
    with pytest.raises(RecipeError, match=reason):
        export(run / words.pop("inside", ""), tmp_path / "out", **words)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("kept")
    with pytest.raises(RecipeError, match="is not empty: pick a new folder"):
        export(run, tmp_path / "full")
    assert (tmp_path / "full" / "mine.txt").read_text() == "kept"
