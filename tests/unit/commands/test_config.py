"""`memrecipe config` (commands/config.py): the launch configs printed, or written without overwriting."""

import yaml


def test_config_prints_then_writes_and_refuses_to_overwrite(cli, tmp_path):
    printed = cli("config", "zero3-offload", "--num-processes", "8")
    assert printed.returncode == 0
    assert "==> zero3_offload_8gpu.yaml <==" in printed.stdout and "==> zero3_offload_8gpu.json <==" in printed.stdout
    out = tmp_path / "deep" / "cfg"
    done = cli("config", "zero3-offload", "--num-processes", "8", "--output-dir", str(out), "max_seq_length=1024")
    assert done.returncode == 0, done.stderr
    written = yaml.safe_load((out / "zero3_offload_8gpu.yaml").read_text())
    assert written["deepspeed_config"]["deepspeed_config_file"] == f"{out}/zero3_offload_8gpu.json"
    before = (out / "zero3_offload_8gpu.json").read_text()
    again = cli("config", "zero3-offload", "--num-processes", "8", "--output-dir", str(out), "per_device_train_batch_size=1")
    assert again.returncode == 2 and "already exists" in again.stderr and "--force" in again.stderr
    assert (out / "zero3_offload_8gpu.json").read_text() == before  # nothing overwritten
    forced = cli("config", "zero3-offload", "--num-processes", "8", "--output-dir", str(out), "--force",
                 "per_device_train_batch_size=1")
    assert forced.returncode == 0 and '"train_micro_batch_size_per_gpu": 1' in (out / "zero3_offload_8gpu.json").read_text()


def test_a_written_recipe_carries_the_recipes_own_numbers_and_the_tiny_models_apply_at_run_time(cli, tmp_path):
    """Without --model, the written recipe is the recipe's (2e-4, 1 epoch, rows of 2048), not the embedded tiny model's
    (5e-3, 3 epochs, 256), which apply only when a run's model is the tiny one; a word for one of those keys is kept
    for every model."""
    from memrecipe.planning.registry import load_recipe

    done = cli("config", "single-gpu-lora", "--output-dir", str(tmp_path / "a"), "lora.r=8")
    assert done.returncode == 0, done.stderr
    written = tmp_path / "a" / "single-gpu-lora.yaml"
    data = yaml.safe_load(written.read_text())
    assert (data["learning_rate"], data["num_train_epochs"], data["max_seq_length"]) == (2e-4, 1.0, 2048)
    assert data["embedded_settings"] is True and data["lora"]["r"] == 8
    real = load_recipe(str(written), ["model_name_or_path=/models/llama"])  # (not read: the numbers alone)
    assert (real.learning_rate, real.num_train_epochs) == (2e-4, 1.0)
    tiny = load_recipe(str(written))  # the run's model is the embedded one: its own settings
    assert (tiny.learning_rate, tiny.num_train_epochs, tiny.max_seq_length) == (5e-3, 3.0, 256)
    cli("config", "single-gpu-lora", "--output-dir", str(tmp_path / "b"), "learning_rate=1e-3")
    kept = load_recipe(str(tmp_path / "b" / "single-gpu-lora.yaml"))
    assert (kept.learning_rate, kept.max_seq_length) == (1e-3, 2048)  # the word, for the tiny model too
