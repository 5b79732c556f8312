"""paths.py: which recipe keys name local files, read from the recipe's own folder and refused when missing."""

from memrecipe.planning.registry import load_recipe


def test_a_recipes_relative_paths_are_read_from_its_own_folder(tmp_path, cli):
    """`memrecipe validate ../own/my.yaml` and a dry run from elsewhere read the recipe's dataset beside it, and a
    missing one is refused before anything runs (before: validate said ok, then the run failed)."""
    own, elsewhere = tmp_path / "own", tmp_path / "elsewhere"
    own.mkdir()
    elsewhere.mkdir()
    (own / "my.yaml").write_text("base: single-gpu-lora\ndataset:\n  - {path: alpaca.jsonl}\nchat_template: chat.jinja\n")
    ok = cli("validate", "../own/my.yaml", cwd=elsewhere)
    assert ok.returncode == 2 and "dataset[0].path: ../own/alpaca.jsonl does not exist" in ok.stderr
    (own / "alpaca.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    ok = cli("validate", "../own/my.yaml", cwd=elsewhere)
    assert ok.returncode == 2 and "chat_template: ../own/chat.jinja does not exist" in ok.stderr
    (own / "chat.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert cli("validate", "../own/my.yaml", cwd=elsewhere).returncode == 0
    dry = cli("run", "sft", "--recipe", "../own/my.yaml", "--dry-run", cwd=elsewhere)
    assert dry.returncode == 0 and str(own / "alpaca.jsonl") in dry.stdout
    (own / "alpaca.jsonl").unlink()
    dry = cli("run", "sft", "--recipe", "../own/my.yaml", "--dry-run", cwd=elsewhere)
    assert dry.returncode == 2 and "alpaca.jsonl does not exist" in dry.stderr
    assert load_recipe("single-gpu-lora", ["dataset=tatsu-lab/alpaca"]).dataset == "tatsu-lab/alpaca"  # a hub id
