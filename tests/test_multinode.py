"""Two machines on one box, rendezvous on 127.0.0.1 (gloo): machine rank 0 through `memrecipe run`,
machine rank 1 through the sbatch script of `memrecipe slurm --cpu` (with stand-ins for Slurm's srun
and scontrol). They train one model together: every step's loss equals a 2-process run on one machine
(fp32, 1e-5)."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from helpers import child_env, free_port, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TRAIN = ["mixed_precision=no", "max_steps=5", "eval_steps=5", "logging_steps=1", "max_seq_length=64"]
SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done  # srun's own options
export SLURM_NODEID="$FAKE_NODEID"
exec "$@"
"""


def wait_for_port(port, process, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0][-3000:]
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"machine 0 did not open port {port} in {timeout} s")


def losses(folder):
    report = json.loads((folder / "report.json").read_text())
    return [h["loss"] for h in report["history"]], report


def test_two_machines_train_like_two_processes_on_one(tmp_path):
    port, job = free_port(), tmp_path / "job"
    done = launch(["memrecipe", "slurm", "ddp", "--nodes", "2", "--gpus-per-node", "1", "--port", str(port), "--cpu",
                   "--output-dir", str(job), *TRAIN])
    assert done.returncode == 0, done.stderr
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", "#!/bin/bash\necho 127.0.0.1\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    slurm = child_env(PATH=f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
                      SLURM_JOB_NODELIST="node[0-1]", SLURM_NNODES="2", SLURM_JOB_ID="7", FAKE_NODEID="1")
    run_dir = job / "runs" / "ddp-7"  # where the script trains: runs/RECIPE-JOBID
    machine0 = subprocess.Popen([sys.executable, "-m", "memrecipe", "run", "sft", "--recipe", "ddp", "--cpu",
                                 "--num-processes", "2", "--num-machines", "2", "--machine-rank", "0",
                                 "--main-process-ip", "127.0.0.1", "--main-process-port", str(port),
                                 "--output-dir", str(run_dir), *TRAIN],
                                env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # On one box both machines match 127.0.0.1 and either could host the rendezvous store; on a cluster
    # only the head node does. So machine 0 starts first (its launcher refuses a port already taken).
    wait_for_port(port, machine0)
    machine1 = subprocess.run(["bash", str(job / "ddp.sbatch")], env=slurm, capture_output=True, text=True,
                              timeout=240)
    out0, _ = machine0.communicate(timeout=120)
    assert machine0.returncode == 0 and machine1.returncode == 0, out0[-3000:] + machine1.stderr[-3000:]

    together, report = losses(run_dir)
    ranks = sorted((p["process_index"], p["num_processes"]) for p in report["processes"])
    assert ranks == [(0, 2), (1, 2)]  # one world of two processes over the two "machines"
    alone = tmp_path / "one-machine"
    done = launch(["memrecipe", "run", "sft", "--recipe", "ddp", "--cpu", "--num-processes", "2",
                   "--main-process-port", str(free_port()),  # not 29500: an earlier test's store may linger there
                   "--output-dir", str(alone), *TRAIN])
    assert done.returncode == 0, done.stderr[-3000:]
    reference, _ = losses(alone)
    assert len(together) == len(reference) == 5 and together[-1] < together[0]
    assert together == pytest.approx(reference, abs=1e-5)
