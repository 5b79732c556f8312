"""`memrecipe slurm`: an sbatch script a user submits as is, with the config it launches."""

import re
import shlex
import subprocess


def write(cli, tmp_path, *args):
    done = cli("slurm", *args, "--output-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    return done


def launch_words(script: str) -> list[str]:
    """The `accelerate launch` words of the script's srun line, with Slurm's variables filled in as
    node 1 of 2 would see them."""
    body = script.split("bash -c '", 1)[1].split("\n'", 1)[0]
    values = {"$SLURM_NNODES": "2", "$((SLURM_NNODES * PROCESSES_PER_NODE))": "16", "$SLURM_NODEID": "1",
              "$MAIN_PROCESS_IP": "10.0.0.1", "$MAIN_PROCESS_PORT": "29500", "$RUN_DIR": "runs/x"}
    body = body.replace("\\\n", " ")
    for key, value in values.items():
        body = body.replace(f'"{key}"', value)
    return shlex.split(body)


def test_sbatch_script_allocates_and_launches_one_launcher_per_node(cli, tmp_path):
    write(cli, tmp_path, "fsdp", "--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu", "--time", "1-00:00:00",
          "learning_rate=2e-5")
    script = (tmp_path / "fsdp.sbatch").read_text()
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(.*)$", script, re.M))
    assert sbatch["nodes"] == "2" and sbatch["gpus-per-node"] == "8" and sbatch["ntasks-per-node"] == "1"
    assert sbatch["partition"] == "gpu" and sbatch["time"] == "1-00:00:00"
    assert "srun --ntasks-per-node=1" in script and "learning_rate=2e-5" in script
    assert {p.name for p in tmp_path.iterdir()} == {"fsdp.sbatch", "fsdp_2x8gpu_rank0.yaml", "sft.py", "dpo.py", "fsdp.yaml"}
    assert subprocess.run(["bash", "-n", str(tmp_path / "fsdp.sbatch")]).returncode == 0  # bash parses it


def test_model_and_dataset_flags_reach_the_loop_with_local_paths_made_absolute(cli, tmp_path, monkeypatch):
    data = tmp_path / "data.jsonl"
    data.write_text("{}")
    monkeypatch.chdir(tmp_path)
    write(cli, tmp_path / "job", "ddp", "--nodes", "2", "--gpus-per-node", "1", "--model", "org/model",
          "--dataset", "data.jsonl")
    last = (tmp_path / "job" / "ddp.sbatch").read_text().splitlines()[-1]
    assert last.endswith(f"model_name_or_path=org/model dataset={data}")  # the script runs from its own folder


def test_the_script_launch_line_is_accepted_by_accelerate_with_the_config(cli, tmp_path):
    """accelerate's own launch validation, with the node's rank and the head's address on the command
    line replacing the config's placeholders."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    write(cli, tmp_path, "zero3-offload", "--nodes", "2", "--gpus-per-node", "8")
    words = launch_words((tmp_path / "zero3-offload.sbatch").read_text())
    assert words[:2] == ["accelerate", "launch"]
    config = tmp_path / words[words.index("--config_file") + 1]
    words[words.index("--config_file") + 1] = str(config)
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(words[2:]))
    assert (args.num_machines, args.num_processes, args.machine_rank) == (2, 16, 1)
    assert args.main_process_ip == "10.0.0.1" and args.rdzv_backend == "c10d" and args.use_deepspeed
    assert args.deepspeed_multinode_launcher == "standard"  # each node runs its own launcher, no pdsh
    assert (tmp_path / "zero3_offload_2x8gpu_rank0.json").is_file()


def test_a_gpu_script_asks_for_the_nodes_cores_and_shares_them_out(cli, tmp_path):
    """Without --cpus-per-task Slurm confines the node's one task, and so all 8 ranks, to one core."""
    write(cli, tmp_path, "zero3-offload", "--nodes", "2", "--gpus-per-node", "8", "--cpus-per-gpu", "12")
    script = (tmp_path / "zero3-offload.sbatch").read_text()
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(.*)$", script, re.M))
    assert sbatch["cpus-per-task"] == "96" and sbatch["gpus-per-node"] == "8"
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export ") and "THREADS" in line
                        or "SRUN_CPUS" in line)
    shown = subprocess.run(["bash", "-c", f"PROCESSES_PER_NODE=8\n{exports}\necho $SRUN_CPUS_PER_TASK $OMP_NUM_THREADS"],
                           env={"SLURM_CPUS_PER_TASK": "96", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert shown.stdout.split() == ["96", "12"]  # srun gets the cores; each of the 8 ranks 12 threads


def test_a_dpo_script_launches_dpo_py_beside_sft_py_and_refuses_what_run_dpo_refuses(cli, tmp_path):
    write(cli, tmp_path, "fsdp-lora", "--nodes", "2", "--gpus-per-node", "8", "--script", "dpo", "dpo.beta=0.2")
    script = (tmp_path / "fsdp-lora.sbatch").read_text()
    words = launch_words(script)
    loop = next(w for w in words if w.endswith(".py"))
    assert loop == "dpo.py" and (tmp_path / "dpo.py").is_file() and (tmp_path / "sft.py").is_file()  # it imports sft
    assert "dpo.beta=0.2" in script and "--script dpo" in script  # (the regenerate line)
    refused = cli("slurm", "tp", "--nodes", "1", "--gpus-per-node", "4", "--script", "dpo", "--output-dir",
                  str(tmp_path / "tp"))
    assert refused.returncode == 2 and "run dpo does not run tensor parallelism" in refused.stderr
    sft = cli("slurm", "fsdp", "--nodes", "1", "--gpus-per-node", "4", "dpo.beta=0.2", "--output-dir", str(tmp_path / "x"))
    assert sft.returncode == 2 and "run sft does not read the dpo: section" in sft.stderr
    assert not (tmp_path / "tp").exists() and not (tmp_path / "x").exists()
