"""`memrecipe show` (commands/show.py): the recipe file as shipped, comments and all."""

from conftest import REPO


def test_show_prints_the_yaml_with_comments(cli):
    done = cli("show", "zero3-offload")
    assert done.returncode == 0
    assert done.stdout == (REPO / "recipes" / "zero3-offload.yaml").read_text()


def test_keys_prints_each_keys_help_and_no_recipe_is_one_line(cli):
    from memrecipe.planning.recipe import Lora, Recipe
    from memrecipe.planning.schema import key_rows

    done = cli("show", "--keys")
    assert done.returncode == 0 and "Traceback" not in done.stderr
    flat = " ".join(done.stdout.split())
    for cls in (Recipe, Lora):
        for names, default, help in key_rows(cls):
            assert f"{names} ({default})".replace("`", "") in flat, names
            assert " ".join(help.replace("`", "").split()) in flat, names
    bare = cli("show")
    assert bare.returncode == 2 and "needs a RECIPE" in bare.stderr and len(bare.stderr.strip().splitlines()) == 1
