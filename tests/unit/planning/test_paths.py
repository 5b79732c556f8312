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


def checksums(folder):
    import hashlib

    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def test_a_model_folder_without_whole_weights_is_one_line_in_a_run_and_a_dry_run(tmp_path, capsys):
    """config.json and no weights, a shard its index lists missing, a model.safetensors cut short: refused by run and
    (but the first, whose weights may just not be there yet) by --dry-run before anything is written (a named folder that exists keeps its files as they were); a whole
    folder (the embedded model's, saved by save_pretrained) passes."""
    import json
    import shutil

    import pytest

    from memrecipe.main import main
    from memrecipe.planning.paths import check_weights
    from memrecipe.training.loading import embedded_model

    whole = embedded_model()
    check_weights(__import__("pathlib").Path(whole))
    weightless, cut, sharded = tmp_path / "weightless", tmp_path / "cut", tmp_path / "sharded"
    for folder in (weightless, cut, sharded):
        shutil.copytree(whole, folder)
    (weightless / "model.safetensors").unlink()
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) // 2])
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    before = checksums(existing)
    for folder, says in ((weightless, "has a config.json but no weights"),
                         (cut, f"model.safetensors is cut short ({len(data) // 2:,} of {len(data):,} bytes)"),
                         (sharded, "model-00002-of-00002.safetensors (listed in model.safetensors.index.json) is "
                                   "missing")):
        for dry in ([], ["--dry-run"]) if folder != weightless else ([],):  # (a dry run of a folder with no weights
            for out in (tmp_path / "new", existing):                        # yet checks the rest: test_run.py)
                with pytest.raises(SystemExit) as done:
                    main(["run", "sft", "--recipe", "single-gpu-lora", "--model", str(folder), "--output-dir", str(out),
                          *dry])
                said = capsys.readouterr().err
                assert done.value.code == 2 and says in said and len(said.strip().splitlines()) == 1, said
                assert not (tmp_path / "new").exists() and checksums(existing) == before


def test_an_adapters_missing_base_names_the_adapter_config_it_came_from(tmp_path, cli):
    import json

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
         "base_model_name_or_path": str(tmp_path / "gone")}))
    done = cli("run", "sft", "--recipe", "single-gpu-lora", "--model", str(tmp_path / "adapter"), "--dry-run")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert f"{tmp_path / 'gone'} does not exist; it is the base_model_name_or_path of the adapter " \
           f"{tmp_path / 'adapter'}/adapter_config.json" in done.stderr
