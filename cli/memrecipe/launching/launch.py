"""Launching a run: the `accelerate launch` command and its environment, run from inside the run
folder, its output streamed to the terminal and train.log, signals passed on."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from ..layout import LAUNCH_CONFIG, RECIPE, machine_file
from ..planning.configs import launch_env, launch_words
from ..planning.recipe import Recipe
from ..planning.registry import data_dir
from ..planning.topology import Topology
from .run_folder import LAUNCHED_BY

SCRIPTS = ("sft", "dpo")  # recipes/<name>.py: the loop scripts
ERROR_LINE = b"memrecipe: error: "  # how the loop reports a RecipeError (recipes/sft.py's __main__)
TRACEBACK = b"Traceback (most recent call last)"
# torchrun passes a stop signal on to the workers and SIGKILLs them 30 s later unless this says otherwise
# (torch/distributed/launcher/api.py, LaunchConfig.shutdown_timeout). A stop finishes its step and writes a
# checkpoint first, which can take minutes (one 751K-token step of an 8B's widths: 159 s on an H200; a busy CI
# machine's 2-process FSDP save once took past 30 s, and the run stopped without its checkpoint): the grace is the
# scheduler's to cut short, or a second Ctrl-C's, not torchrun's.
SHUTDOWN_TIMEOUT, STOP_GRACE = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 3600


def launch(script: str, recipe: Recipe, topo: Topology, cores: int, extra=()) -> tuple[list[str], dict[str, str]]:
    """`accelerate launch` as `memrecipe run` runs it from inside the run folder: (its words, the environment it
    needs on top of the user's)."""
    # `accelerate launch`'s own module, in this Python: the same launch_command and arguments, without the imports of
    # accelerate's other commands (`estimate` imports transformers): ~1 s less start-up for every run.
    words = [sys.executable, "-m", "accelerate.commands.launch"]
    share = str(max(1, cores // topo.processes_per_machine))  # each process's share of this machine's cores
    threads = ["--num_cpu_threads_per_process", share] if topo.cpu else []  # (accelerate warns and guesses otherwise)
    sft = data_dir("recipes") / f"{script}.py"
    words += launch_words(machine_file(LAUNCH_CONFIG, topo.machine_rank), str(sft),
                          machine_file(RECIPE, topo.machine_rank), topo.num_machines, topo.machine_rank, threads,
                          ["--output-dir", ".", *extra])
    env = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", LAUNCHED_BY: "1", **launch_env(recipe, topo)}
    if not topo.cpu and recipe.deepspeed is not None:
        # accelerate launches DeepSpeed through torchrun, which sets 1 thread per process when a node runs
        # several (torch/distributed/run.py, "OMP_NUM_THREADS" not in os.environ and nproc_per_node > 1),
        # and --num_cpu_threads_per_process is not applied on that path: DeepSpeed's CPU Adam would run
        # on one core per rank. Each rank gets its share of the machine's cores.
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or share
    if topo.cpu:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed would guess the CPU anyway, with a warning
    if SHUTDOWN_TIMEOUT not in os.environ:
        env[SHUTDOWN_TIMEOUT] = str(STOP_GRACE)
    return words, env


class LaunchOutput:
    """What the launch prints, for the terminal and train.log. It passes through as it comes (progress
    bars redraw in place) until the loop reports an error in its one line, or a signal asks the run to
    stop; from then on it goes line by line, without what only repeats the story: after the error line
    nothing more (each launcher's traceback: accelerate's CalledProcessError, torchrun's ChildFailedError
    summary, the other ranks' copies of the line); after a stop signal, no traceback of a launcher's
    reaction to it (KeyboardInterrupt, torchrun's SignalException, accelerate's CalledProcessError for
    the loop's exit status 130 or 143), while the loop's own lines (its
    checkpoint, its resume hint) and any other traceback still show."""

    def __init__(self):
        self.pending, self.shown = b"", 0  # the unfinished line, and how much of it the terminal has
        self.filtering, self.held = False, []
        self.error: str | None = None

    def feed(self, chunk: bytes) -> tuple[bytes, list[str]]:
        """(bytes for the terminal, complete lines for the log)."""
        data = self.pending + chunk
        *lines, self.pending = data.split(b"\n")
        if not self.filtering and ERROR_LINE not in data:
            self.shown = len(self.pending)
            return chunk, [self._text(line) for line in lines]
        self.filtering = True
        out, kept = b"", []
        for n, line in enumerate(lines):
            for shown in self._lines(line):
                # the start of the first line may be on the terminal already (it came before the filtering)
                skip = self.shown if n == 0 and line.startswith(shown) else 0
                out += (shown + b"\n")[skip:]
                kept.append(self._text(shown))
        self.shown = 0 if lines else self.shown
        return out, kept

    def finish(self) -> list[str]:
        """The last unfinished line, and a traceback held back that never ended."""
        rest, self.pending = self.pending, b""
        if not self.filtering:
            return [self._text(rest)] if rest else []
        out = [*self.held, *(self._lines(rest) if rest else [])]
        self.held = []
        return [self._text(line) for line in out]

    def _lines(self, line: bytes) -> list[bytes]:
        """What of `line` (and of a traceback held back so far) goes out."""
        text = line.rsplit(b"\r", 1)[-1]
        if self.error is not None:
            return []
        for mark in (ERROR_LINE, TRACEBACK):  # one that starts after a progress bar's last frame: two lines
            at = text.find(mark)
            if at > 0:
                return self._lines(text[:at]) + self._lines(text[at:])
        if text.startswith(ERROR_LINE):
            self.error = self._text(text)
            return [line]
        if text.startswith((TRACEBACK, b"During handling of the above exception")) or (
                self.held and (not text or text[:1] in (b" ", b"\t"))):
            self.held.append(line)  # a traceback, held until its last line says what it was
            return []
        if self.held:  # the exception's own line: a launcher's reaction to the signal is dropped, anything else shown
            held, self.held = self.held, []
            signalled = (text.startswith(b"KeyboardInterrupt") or b"SignalException: Process" in text  # torchrun's
                         or text.rstrip(b".").endswith((b"exit status 130", b"exit status 143")))  # accelerate's
            return [] if signalled else [*held, line]
        return [line]

    @staticmethod
    def _text(line: bytes) -> str:
        return line.rsplit(b"\r", 1)[-1].decode("utf-8", "replace")


def stream(command: list[str], cwd: Path, env: dict, log: Path) -> tuple[int, int, str | None]:
    """Run the launch; its output goes to the terminal and to train.log (progress-bar redraws left
    out; see LaunchOutput). SIGTERM and SIGINT are passed on to every process of the launch, which
    then checkpoints and stops. Returns (exit status, the signal that asked it to stop or 0, the
    loop's error line or None)."""
    received = []
    output = LaunchOutput()

    def forward(signum, frame):
        received.append(signum)
        output.filtering = True
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    command, env = one_process(command, cwd, env) or (command, {**os.environ, **env})
    with open(log, "a", encoding="utf-8") as sink:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            # the pipe closes when the last process of the launch (worker included) has exited
            while chunk := proc.stdout.read1(65536):  # pyright: ignore[reportAttributeAccessIssue]  (a BufferedReader)
                shown, lines = output.feed(chunk)
                sys.stdout.buffer.write(shown)
                sys.stdout.buffer.flush()
                sink.writelines(line + "\n" for line in lines)
                sink.flush()
            sink.writelines(line + "\n" for line in output.finish())
            status = proc.wait()  # (a loop killed by a signal: the shell's 128 + its number, as a launcher says it)
            return (128 - status if status < 0 else status), (received[0] if received else 0), output.error
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def one_process(command: list[str], cwd: Path, env: dict) -> tuple[list[str], dict[str, str]] | None:
    """The loop's own command and environment when `accelerate launch` would start it as one plain process (its
    simple launcher, chosen for one process that is neither torchrun's nor DeepSpeed's), worked out here by
    accelerate's own code; None for any other launch, which keeps accelerate's process. Started directly, such a run
    skips a Python process that only imports torch and accelerate again (a 2-step CPU run: 14.1 -> 12.7 s)."""
    if command[1:3] != ["-m", "accelerate.commands.launch"]:
        return None
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import ComputeEnvironment, patch_environment
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    args = launch_command_parser().parse_args(command[3:])
    args.config_file = str(cwd / args.config_file)  # (the launch would run inside the run folder)
    with patch_environment(**env):
        args, defaults, _ = _validate_launch_command(args)
        # accelerate/commands/launch.py, launch_command: every launcher but the simple one is chosen only without --cpu
        other = args.use_deepspeed or args.use_fsdp or args.use_megatron_lm or args.multi_gpu or args.tpu
        if (other and not args.cpu) or (defaults is not None and
                                        defaults.compute_environment == ComputeEnvironment.AMAZON_SAGEMAKER):
            return None
        return prepare_simple_launcher_cmd_env(args)  # (the environment: this one, as the launcher's would be)


def shell_form(command: list[str], env: dict, cwd: Path) -> str:
    words = [f"{k}={shlex.quote(v)}" for k, v in env.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"]
    return f"cd {shlex.quote(str(cwd))} && " + " ".join(words + [shlex.join(command)])
