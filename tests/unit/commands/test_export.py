"""`memrecipe export` (commands/export.py): a folder that is not there, or not a run, is one line, exit 2."""


def test_a_missing_or_foreign_folder_is_one_line(cli, tmp_path):
    missing = cli("export", str(tmp_path / "nowhere"), str(tmp_path / "out"))
    assert missing.returncode == 2 and "nowhere does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr and not (tmp_path / "out").exists()
    foreign = cli("export", str(tmp_path), str(tmp_path / "out"))
    assert foreign.returncode == 2 and "is not a memrecipe run folder (no recipe.yaml)" in foreign.stderr
