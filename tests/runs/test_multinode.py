"""Two machines on one box, rendezvous on 127.0.0.1 (gloo). They train one model together: every step's
loss equals a 2-process run on one machine (fp32, 1e-5). Twice: once sharing one run folder (machine 1
started by the sbatch script of `memrecipe slurm --cpu`, with stand-ins for Slurm's srun and scontrol),
once with a folder each, as machines without a shared filesystem have; both leave checkpoints that
every machine can resume from."""

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import child_env, free_port, launch, pin

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
# a constant learning rate: a run resumed with a longer max_steps then trains exactly like an uninterrupted one
TRAIN = ["mixed_precision=no", "logging_steps=1", "max_seq_length=64", "lr_scheduler_type=constant", "save_steps=2"]
SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done  # srun's own options
export SLURM_NODEID="$FAKE_NODEID"
exec "$@"
"""
MACHINE = ["memrecipe", "run", "sft", "--recipe", "ddp", "--cpu", "--num-processes", "2", "--num-machines", "2",
           "--main-process-ip", "127.0.0.1"]


def wait_for_port(port, process, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0][-3000:]
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"machine 0 did not open port {port} in {timeout} s")


def two_machines(words0, port, machine1, **run1):
    """Machine 0 first (on one box both machines match 127.0.0.1 and either could host the rendezvous
    store; on a cluster only the head node does), then machine 1 once its port is open."""
    machine0 = subprocess.Popen([sys.executable, "-m", *words0], env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    wait_for_port(port, machine0)
    done1 = subprocess.run(machine1, capture_output=True, text=True, timeout=240, **run1)
    out0, _ = machine0.communicate(timeout=120)
    assert machine0.returncode == 0 and done1.returncode == 0, out0[-3000:] + done1.stderr[-3000:]
    return out0


def losses(folder):
    report = json.loads((folder / "report.json").read_text())
    return [h["loss"] for h in report["history"]], report


def checkpoints(folder):
    return sorted(p.name for p in (folder / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same 6 steps by 2 processes on one machine, launched beside the first test's machines: call it for the
    losses."""
    alone = tmp_path_factory.mktemp("one-machine")

    def run():
        done = launch(["memrecipe", "run", "sft", "--recipe", "ddp", "--cpu", "--num-processes", "2",
                       "--main-process-port", str(free_port()),  # not 29500: an earlier test's store may linger there
                       "--output-dir", str(alone), "max_steps=6", *TRAIN], preexec_fn=pin(None))
        assert done.returncode == 0, done.stderr[-3000:]
        reference, _ = losses(alone)
        assert len(reference) == 6 and reference[-1] < reference[0]
        return reference

    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(run).result


def test_two_machines_sharing_a_folder_train_like_two_processes_on_one(tmp_path, reference):
    port, job = free_port(), tmp_path / "job"
    done = launch(["memrecipe", "slurm", "ddp", "--nodes", "2", "--gpus-per-node", "1", "--port", str(port), "--cpu",
                   "--output-dir", str(job), "max_steps=6", *TRAIN])
    assert done.returncode == 0, done.stderr
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", "#!/bin/bash\necho 127.0.0.1\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    slurm = child_env(PATH=f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
                      SLURM_JOB_NODELIST="node[0-1]", SLURM_NNODES="2", SLURM_JOB_ID="7", FAKE_NODEID="1")
    run_dir = job / "runs" / "ddp-7"  # where the script trains: runs/RECIPE-JOBID
    out0 = two_machines([*MACHINE, "--machine-rank", "0", "--main-process-port", str(port), "--output-dir",
                         str(run_dir), "max_steps=6", *TRAIN], port, ["bash", str(job / "ddp.sbatch")], env=slurm)
    assert "2 machines share the run folder" in out0

    together, report = losses(run_dir)
    ranks = sorted((p["process_index"], p["num_processes"]) for p in report["processes"])
    assert ranks == [(0, 2), (1, 2)]  # one world of two processes over the two "machines"
    assert together == pytest.approx(reference(), abs=1e-5)
    # renamed and pruned once (save_total_limit 2): whole checkpoints, no staging or probe left behind
    assert checkpoints(run_dir) == ["step-4", "step-6"]
    assert not list(run_dir.glob(".probe-*"))


def test_machines_with_a_folder_each_write_whole_checkpoints_and_resume(tmp_path, reference):
    """No shared filesystem: each machine's folder gets a whole checkpoint (model, optimizer, trainer state)
    and both machines resume from their own to the same losses as the uninterrupted one-machine run."""
    port, folders = free_port(), [tmp_path / "machine0", tmp_path / "machine1"]

    def machine(rank, *words):
        return [*MACHINE, "--machine-rank", str(rank), "--main-process-port", str(port),
                "--output-dir", str(folders[rank]), *words, *TRAIN]

    out0 = two_machines(machine(0, "max_steps=4"), port, [sys.executable, "-m", *machine(1, "max_steps=4")],
                        env=child_env())
    assert "each keep their own run folder" in out0
    for folder in folders:
        assert checkpoints(folder) == ["step-2", "step-4"]
        step = folder / "checkpoints" / "step-4"
        assert json.loads((step / "trainer_state.json").read_text())["step"] == 4
        assert (step / "model.safetensors").stat().st_size > 0 and (step / "optimizer.bin").is_file()
    two_machines(machine(0, "--resume", "max_steps=6"), port,
                 [sys.executable, "-m", *machine(1, "--resume", "max_steps=6")], env=child_env())
    resumed, _ = losses(folders[0])
    assert resumed == pytest.approx(reference(), abs=1e-5)
