"""Shared by tests and the worker scripts they launch: tiny models, uneven data, launching."""

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"


def loop_model(recipe, model_path, precision="no", device=None, device_mesh=None, run_folder=None, engine="NO"):
    """The model as the loop builds it (recipes/sft.py's own setup_model: memory techniques, LoRA, compile, the
    fused head), outside a launch (`engine`: the accelerator's distributed type it is built for). Returns (model,
    activation offload hooks or None)."""
    import tempfile
    from types import SimpleNamespace

    if str(RECIPES) not in sys.path:
        sys.path.insert(0, str(RECIPES))
    from sft import setup_model

    accelerator = SimpleNamespace(mixed_precision=precision, device=device or torch.device("cpu"),
                                  native_amp=precision != "no" and engine != "DEEPSPEED",  # (accelerate's rule)
                                  torch_device_mesh=device_mesh, is_main_process=True,
                                  distributed_type=SimpleNamespace(value=engine))
    folder = Path(run_folder or tempfile.mkdtemp(prefix="memrecipe-loop-model-"))
    model, offload, _ = setup_model(recipe, model_path, accelerator, SimpleNamespace(
        initial_adapter=folder / "initial_adapter"), lambda *a, **k: None)
    return model, offload


def tiny_model(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def uneven_examples(n=8, seed=1):
    """n sequences of very different lengths, each with a masked prompt of different length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 40, (1,), generator=g))
        prompt = int(torch.randint(1, length - 2, (1,), generator=g))
        ids = torch.randint(0, 64, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    env.update(extra)
    return env


def launch(args, cwd=None, env=None, timeout=600, preexec_fn=None):
    """Run `accelerate launch ARGS` (or `memrecipe ...`); returns the CompletedProcess."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *args] if args and args[0] != "memrecipe" else \
        [sys.executable, "-m", "memrecipe", *args[1:]]
    return subprocess.run(cmd, cwd=cwd, env=env or child_env(), capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec_fn)


def start(args, folder, core=None, script="sft"):
    """`memrecipe run SCRIPT ...` in its own process group, output to folder.log, with a free rendezvous port of its own
    (two launchers probing accelerate's default port at once both take it); `core`: pinned to that core."""
    log = open(f"{folder}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "memrecipe", "run", script, "--output-dir", str(folder),
                             "--main-process-port", str(free_port()), *args], env=child_env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin(core))


def pin(core):
    """Where a launched run computes. `core` (a SideBySide slot): a 1-process run pinned to a core of its own takes 1
    thread (its launcher reads the cores it may use), where two of 2 threads each would thrash; every run of a test
    pinned, so each trains with the same threads. Under `pytest -n` the slot is a core of this worker's lane (its one
    core, conftest.py). None: a run of several processes, given every core the test run may use (its launcher refuses
    more processes than cores, and each process takes 1 thread of its share anyway)."""
    if core is None:
        every = os.environ.get("TESTS_CORES")  # (outside `pytest -n` nothing is pinned: the run inherits every core)
        if every is None:
            return None
        return lambda: os.sched_setaffinity(0, map(int, every.split(",")))
    cores = sorted(os.sched_getaffinity(0))
    return lambda: os.sched_setaffinity(0, {cores[core % len(cores)]})


def wait_for(predicate, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended early ({proc.returncode})"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def finish(*procs):
    """Wait for runs started side by side (a launch is mostly start-up, one core's work: two share the machine)."""
    for proc in procs:
        assert proc.wait(timeout=600) == 0, open(f"{proc.args[proc.args.index('--output-dir') + 1]}.log").read()[-3000:]


def stop_at_a_checkpoint(proc, folder) -> int:
    """SIGSTOP every process of the run as soon as a checkpoint is complete, then SIGKILL them: no chance to clean up
    (the lock and maybe a .tmp checkpoint stay). Returns the newest complete checkpoint's step, the one a resume
    must start from: pinned, not guessed, however far the run got before the stop."""
    from memrecipe.layout import NAME, complete_checkpoints

    wait_for(lambda: complete_checkpoints(folder), proc)
    signal_tree(proc, signal.SIGSTOP)
    step = int(NAME.match(complete_checkpoints(folder)[-1].name).group(1))
    signal_tree(proc, signal.SIGKILL)
    proc.wait()
    return step


def signal_tree(proc, sig):
    """`sig` to the run's every process, as a scheduler's kill or a lost machine: torch's elastic agent starts each
    worker in a session of its own, out of reach of the launcher's process group (a SIGKILL to that group alone
    leaves the workers training)."""
    import psutil

    for pid in [proc.pid, *(child.pid for child in psutil.Process(proc.pid).children(recursive=True))]:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(pid), sig)


class SideBySide:
    """Launches two at a time (a launch is mostly start-up, one core's work: two share this 2-core machine), in
    the order given, started by the first request; `jobs[name](core)` runs one and returns its result (`core`: the
    slot it holds, for a 1-process run to pin itself to). Calling the object with a name waits for that one."""

    def __init__(self, jobs: dict):
        self.jobs, self.futures, self.cores = jobs, {}, queue.Queue()
        for core in (0, 1):
            self.cores.put(core)
        self.pool = ThreadPoolExecutor(max_workers=2)

    def _run(self, name):
        core = self.cores.get()
        try:
            return self.jobs[name](core)
        finally:
            self.cores.put(core)

    def __call__(self, name):
        if not self.futures:
            self.futures = {n: self.pool.submit(self._run, n) for n in self.jobs}
        return self.futures[name].result()

    def close(self):
        self.pool.shutdown(cancel_futures=True)  # (a -k run that needed one waits for the running two only)
