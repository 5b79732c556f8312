"""`memrecipe config` (commands/config.py): the launch configs printed, or written without overwriting."""

import yaml


def test_config_prints_then_writes_and_refuses_to_overwrite(cli, tmp_path):
    printed = cli("config", "zero3-offload", "--num-processes", "8")
    assert printed.returncode == 0
    assert "==> zero3_offload_8gpu.yaml <==" in printed.stdout and "==> zero3_offload_8gpu.json <==" in printed.stdout
    out = tmp_path / "deep" / "cfg"
    done = cli("config", "zero3-offload", "--num-processes", "8", "--output-dir", str(out), "max_seq_length=1024")
    assert done.returncode == 0, done.stderr
    written = yaml.safe_load((out / "zero3_offload_8gpu.yaml").read_text())
    assert written["deepspeed_config"]["deepspeed_config_file"] == f"{out}/zero3_offload_8gpu.json"
    before = (out / "zero3_offload_8gpu.json").read_text()
    again = cli("config", "zero3-offload", "--num-processes", "8", "--output-dir", str(out), "per_device_train_batch_size=1")
    assert again.returncode == 2 and "already exists" in again.stderr and "--force" in again.stderr
    assert (out / "zero3_offload_8gpu.json").read_text() == before  # nothing overwritten
    forced = cli("config", "zero3-offload", "--num-processes", "8", "--output-dir", str(out), "--force",
                 "per_device_train_batch_size=1")
    assert forced.returncode == 0 and '"train_micro_batch_size_per_gpu": 1' in (out / "zero3_offload_8gpu.json").read_text()
