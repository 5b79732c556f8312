"""files.py: a refusal leaves nothing half-written, and what is written reads back."""

import os

import pytest

from memrecipe.errors import RecipeError
from memrecipe.files import make_folder, readable_files, write_files


def test_files_are_written_into_a_new_folder_and_read_back(tmp_path):
    written = write_files(tmp_path / "a" / "b", {"x.yaml": "x: 1\n", "y.json": "{}"})
    assert [p.read_text() for p in written] == ["x: 1\n", "{}"]


def test_an_existing_file_refuses_the_whole_write_and_changes_nothing(tmp_path):
    (tmp_path / "y.json").write_text("mine")
    with pytest.raises(RecipeError, match=r"y.json already exists: pass --force"):
        write_files(tmp_path, {"x.yaml": "x: 1\n", "y.json": "{}"})
    assert not (tmp_path / "x.yaml").exists() and (tmp_path / "y.json").read_text() == "mine"
    write_files(tmp_path, {"x.yaml": "x: 1\n", "y.json": "{}"}, force=True)
    assert (tmp_path / "y.json").read_text() == "{}"


def test_a_file_in_the_way_of_a_folder_is_one_line_with_the_fix(tmp_path):
    (tmp_path / "out").write_text("")
    with pytest.raises(RecipeError, match=r"out is a file, not a folder: use another --output-dir$"):
        make_folder(tmp_path / "out", "use another --output-dir")


def test_saved_files_get_the_permissions_of_any_new_file(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    weights.chmod(0o600)  # as safetensors leaves them
    umask = os.umask(0o022)
    try:
        readable_files(tmp_path)
    finally:
        os.umask(umask)
    assert weights.stat().st_mode & 0o777 == 0o644
