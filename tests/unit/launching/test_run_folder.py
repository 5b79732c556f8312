"""run_folder.py: the run folder's files, per machine."""


def test_other_machines_keep_their_own_launch_files_in_a_shared_folder(cli, tmp_path):
    """Machine rank 1 of a run writes *.machine1.* files and its own lock, so a folder shared by the
    machines holds both; machine rank 0 owns the plain names and ignores the others' files."""
    from memrecipe.launching.run_folder import RunFolder

    words = ["run", "sft", "--recipe", "zero2", "--cpu", "--num-processes", "2", "--num-machines", "2",
             "--main-process-ip", "127.0.0.1", "--output-dir", str(tmp_path), "--dry-run"]
    done = cli(*words, "--machine-rank", "1")
    assert done.returncode == 0, done.stderr
    for name in ("recipe.machine1.yaml", "accelerate_config.machine1.yaml", "deepspeed_config.machine1.json"):
        assert f"==> {tmp_path / name} <==" in done.stdout
    assert "--config_file accelerate_config.machine1.yaml" in done.stdout
    assert "deepspeed_config_file: deepspeed_config.machine1.json" in done.stdout
    assert "--recipe recipe.machine1.yaml" in done.stdout
    for name in ("recipe.machine1.yaml", "train.machine1.log", ".lock.machine1"):
        (tmp_path / name).write_text("x")
    assert RunFolder(tmp_path).owned() == []  # machine 0 may start in this folder without --overwrite
