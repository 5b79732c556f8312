"""`memrecipe ls` (commands/ls.py): every recipe in a table a person reads at a glance, on 80 columns."""

def test_ls_lists_every_recipe_with_what_it_saves_and_costs(cli):
    done = cli("ls")
    assert done.returncode == 0
    for name in ("single-gpu-lora", "fsdp", "zero3-offload", "adamw-8bit"):
        assert name in done.stdout
    for header in ("TECHNIQUES", "PROCESSES", "SAVES", "COSTS"):
        assert header in done.stdout
    assert "ZeRO-3" in done.stdout and "FSDP2" in done.stdout and "LoRA" in done.stdout


def test_ls_and_show_fit_an_80_column_terminal_and_show_stays_the_same_yaml(monkeypatch):
    import yaml
    from click.testing import CliRunner

    from memrecipe.commands import ls, show
    from memrecipe.main import cli

    for module in (ls, show):
        monkeypatch.setattr(module, "terminal_width", lambda: 80)
    listed = CliRunner().invoke(cli, ["ls"]).output
    assert max(map(len, listed.splitlines())) <= 80
    assert "TECHNIQUES" not in listed and "zero3-offload  (processes: 1+" in listed  # a block each
    for name in ("single-gpu-lora", "qlora", "fsdp"):
        shown = CliRunner().invoke(cli, ["show", name]).output
        assert yaml.safe_load(shown) == yaml.safe_load(show.recipe_path(name).read_text())  # wrapped comments only
        long = [line for line in shown.splitlines() if len(line) > 80]
        assert all("#" not in line for line in long), long  # what is still long is a value, not a comment
    monkeypatch.setattr(show, "terminal_width", lambda: None)  # piped: the file as shipped
    assert CliRunner().invoke(cli, ["show", "qlora"]).output == show.recipe_path("qlora").read_text()
