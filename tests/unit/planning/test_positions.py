"""planning/positions.py: the positions a model knows, what max_seq_length asks of them (said by plan and run), and
the rope_parameters rope_scaling writes into the model's config (the loop's side: test_loading.py)."""

from memrecipe.planning.architecture import read_config
from memrecipe.planning.registry import load_recipe


def test_rows_past_the_models_positions_are_said_with_the_rope_scaling_that_reaches_them(cli):
    """Llama-3.1-8B knows 131,072 positions: at 262,144 plan says so and names rope_scaling (factor 2 from the
    ratio); with rope_scaling.rope_type=yarn it says what the scaling reaches; within them, nothing."""
    from helpers import REPO
    from memrecipe.planning.positions import positions_note, rope_parameters

    config = REPO / "benchmarks" / "gpu_configs" / "llama-3.1-8b.json"
    words = ["--model", str(config), "--gpu-memory", "80GB", "--recipe", "single-gpu-lora", "per_device_train_batch_size=1"]
    past = cli("plan", *words, "max_seq_length=262144")
    assert "max_seq_length 262,144 passes the model's max_position_embeddings 131,072" in past.stdout
    assert "rope_scaling.rope_type=yarn scales RoPE to them (factor 2, from the ratio" in past.stdout
    scaled = cli("plan", *words, "max_seq_length=262144", "rope_scaling.rope_type=yarn")
    assert "rope_scaling: yarn x2 from 131,072 positions, to 262,144" in scaled.stdout and "passes" not in scaled.stdout
    within = cli("plan", *words, "max_seq_length=8192")
    assert "max_position_embeddings" not in within.stdout and "rope_scaling" not in within.stdout
    r = load_recipe("single-gpu-lora", ["model_name_or_path=/x", "max_seq_length=300000", "rope_scaling.factor=2"])
    assert rope_parameters(r, read_config(str(config)))["rope_theta"] == 500000.0  # the model's own theta kept
    assert "still passes them: raise rope_scaling.factor to 2.29" in positions_note(r, read_config(str(config)))
