"""`memrecipe validate` (commands/validate.py): recipes and accelerate configs checked by their own loaders."""

from conftest import REPO


def test_validate_checks_recipes_and_accelerate_configs(cli, tmp_path):
    assert cli("validate", str(REPO / "recipes" / "fsdp.yaml")).returncode == 0
    ok = cli("validate", "zero3_offload_cpu2.yaml", cwd=REPO / "accelerate_configs")
    assert ok.returncode == 0 and "accelerate config" in ok.stdout, ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: 2\n"
                   "fsdp_config:\n  fsdp_versoin: 2\n")
    done = cli("validate", str(bad))
    assert done.returncode == 2 and "fsdp_config.fsdp_versoin" in done.stderr and "fsdp_version" in done.stderr
    worse = tmp_path / "worse.yaml"
    worse.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: NO\nnum_procesess: 2\n")
    done = cli("validate", str(worse))
    assert done.returncode == 2 and "num_procesess" in done.stderr
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_paramz": {}}}')
    done = cli("validate", str(ds))
    assert done.returncode == 2 and "offload_paramz" in done.stderr
