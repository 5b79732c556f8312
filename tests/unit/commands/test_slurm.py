"""`memrecipe slurm` (commands/slurm.py): requests it cannot turn into a job are one line, exit 2 (the script it
writes: tests/unit/launching/test_slurm.py)."""



def test_bad_slurm_requests_are_refused_in_one_line(cli, tmp_path):
    for args, words in ((["single-gpu-lora", "--nodes", "2", "--gpus-per-node", "1"], "supports.max_processes"),
                        (["fsdp", "--nodes", "0", "--gpus-per-node", "8"], "--nodes, --gpus-per-node and --cpus-per-gpu must be >= 1")):
        done = cli("slurm", *args, "--output-dir", str(tmp_path / "x"))
        assert done.returncode == 2 and words in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
