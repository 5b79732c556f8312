"""`memrecipe cp` (commands/cp.py): a recipe's loop, recipe and configs copied side by side."""

from conftest import REPO


def test_cp_copies_side_by_side_and_refuses_to_overwrite(cli, tmp_path):
    dest = tmp_path / "deep" / "train"
    done = cli("cp", "fsdp", str(dest))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["dpo.py", "fsdp.yaml", "fsdp_8gpu.yaml", "fsdp_cpu2.yaml", "sft.py"]
    assert "--config_file fsdp_cpu2.yaml sft.py --recipe fsdp.yaml" in (dest / "fsdp.yaml").read_text()
    assert "accelerate_configs/" not in (dest / "fsdp_cpu2.yaml").read_text()
    (dest / "sft.py").write_text("# my edits\n")
    again = cli("cp", "fsdp", str(dest))
    assert again.returncode == 2 and "already exists: pass --force" in again.stderr
    assert (dest / "sft.py").read_text() == "# my edits\n"
    assert cli("cp", "fsdp", str(dest), "--force").returncode == 0
    assert (dest / "sft.py").read_text() == (REPO / "recipes" / "sft.py").read_text()
