"""`memrecipe show` (commands/show.py): the recipe file as shipped, comments and all."""

from conftest import REPO


def test_show_prints_the_yaml_with_comments(cli):
    done = cli("show", "zero3-offload")
    assert done.returncode == 0
    assert done.stdout == (REPO / "recipes" / "zero3-offload.yaml").read_text()
