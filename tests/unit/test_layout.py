"""layout.py: the run folder's names, and what a complete checkpoint is."""

import json

from memrecipe.layout import STATE, checkpoint_files, complete_checkpoints, lost_files, machine_file


def checkpoint(run, step, files=None, complete=True):
    folder = run / "checkpoints" / f"step-{step}"
    folder.mkdir(parents=True)
    for name, text in (files or {"model.safetensors": "weights"}).items():
        (folder / name).write_text(text)
    if complete:  # the trainer state is written last, listing the files before it
        (folder / STATE).write_text(json.dumps({"files": checkpoint_files(folder)}))
    return folder


def test_complete_checkpoints_are_in_step_order_and_a_half_written_one_is_not_one(tmp_path):
    for step in (100, 20, 3):
        checkpoint(tmp_path, step)
    checkpoint(tmp_path, 200, complete=False)
    (tmp_path / "checkpoints" / "step-x").mkdir()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-3", "step-20", "step-100"]
    assert complete_checkpoints(tmp_path / "elsewhere") == []


def test_a_file_lost_or_cut_short_after_the_save_is_named(tmp_path):
    folder = checkpoint(tmp_path, 1, {"model.safetensors": "weights", "optimizer.bin": "state"})
    assert lost_files(folder) == []
    (folder / "model.safetensors").write_text("weig")
    (folder / "optimizer.bin").unlink()
    assert lost_files(folder) == ["model.safetensors", "optimizer.bin"]


def test_machine_0_owns_the_plain_names_and_the_others_their_own():
    assert machine_file("accelerate_config.yaml") == "accelerate_config.yaml"
    assert machine_file("accelerate_config.yaml", 1) == "accelerate_config.machine1.yaml"
    assert machine_file("deepspeed_config.json", 2) == "deepspeed_config.machine2.json"
