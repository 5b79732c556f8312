"""The launcher: check the run, lay out the run folder, start `accelerate launch`, stream its output.

The only module besides the loop that touches processes and disk.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import yaml

from .architecture import read_config, structure
from .checkpoint import complete_checkpoints
from .errors import RecipeError
from .generator import accelerate_config, deepspeed_config, render_json, render_yaml
from .hardware import Machine
from .planner import METHODS, breakdown, estimate, judge, method
from .recipe import Recipe
from .registry import data_dir, load_recipe, recipe_names
from .run_folder import DEEPSPEED_CONFIG, LAUNCH_CONFIG, RECIPE, RunFolder, machine_file
from .topology import Topology, check_supported, make_topology
from .units import GiB

SCRIPTS = ("sft",)


def plan_topology(recipe: Recipe, machine: Machine, num_processes=None, num_machines=1, machine_rank=0,
                  main_process_ip=None, main_process_port=None, cpu=False) -> Topology:
    """The topology for this run: the flags, else every GPU (as many as the recipe takes), else
    the CPU smoke-test form (1 process, or 2 for recipes that shard)."""
    cpu = cpu or machine.gpus == 0
    s = recipe.supports
    if num_processes is None:
        if cpu:
            num_processes = 1 if s.max_processes == 1 and s.min_processes == 1 else max(2, s.min_processes)
        else:
            num_processes = min(machine.gpus, s.max_processes or machine.gpus) * num_machines
    topo = make_topology(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, cpu,
                         None if cpu else machine.bf16)
    check_supported(recipe, topo)
    local = topo.processes_per_machine
    if not cpu and local > machine.gpus:
        raise RecipeError(f"{local} processes per machine need {local} GPUs; this machine has {machine.gpus}: "
                          f"lower --num-processes")
    if cpu and local > machine.cores:
        raise RecipeError(f"{local} CPU processes need {local} cores; this machine has {machine.cores} (to prepare "
                          f"a GPU run from here: memrecipe config {recipe.name} --num-processes {num_processes}, "
                          f"or memrecipe slurm {recipe.name}, write its files)")
    return topo


PATH_KEYS = ("model_name_or_path", "dataset", "eval_dataset", "chat_template")  # keys that may name local files


def absolute_path(value):
    """A local path made absolute (runs start inside their own folder); hub ids, inline templates, None and
    each entry of a dataset list: the same, their paths made absolute."""
    if isinstance(value, tuple):
        return tuple(replace(entry, path=absolute_path(entry.path)) for entry in value)
    if value and "{" not in value and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    return value


def absolute_paths(recipe: Recipe) -> Recipe:
    """The recipe with its local model/dataset/template paths made absolute."""
    return replace(recipe, **{key: absolute_path(getattr(recipe, key)) for key in PATH_KEYS})


def run_files(recipe: Recipe, topo: Topology) -> dict[str, str]:
    """The run folder's resolved recipe and launch configs (this machine's); paths inside are
    relative to the folder."""
    name = lambda n: machine_file(n, topo.machine_rank)  # noqa: E731
    files = {name(RECIPE): f"# Resolved recipe of this run: the single source of truth for it.\n{recipe.to_yaml()}"}
    ds = deepspeed_config(recipe, topo)
    header = [f"memrecipe run of recipe {recipe.name} on {topo.describe()}."]
    files[name(LAUNCH_CONFIG)] = render_yaml(accelerate_config(recipe, topo, name(DEEPSPEED_CONFIG) if ds else None),
                                             header)
    if ds is not None:
        files[name(DEEPSPEED_CONFIG)] = render_json(ds, f"memrecipe run of recipe {recipe.name} on {topo.describe()}")
    return files


def launch_env(recipe: Recipe, topo: Topology, cores: int) -> dict[str, str]:
    """Environment the launch needs on top of the user's."""
    env = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", LAUNCHED_BY: "1"}
    if not topo.cpu and recipe.deepspeed is not None:
        # accelerate launches DeepSpeed through torchrun, which sets 1 thread per process when a node runs
        # several (torch/distributed/run.py, "OMP_NUM_THREADS" not in os.environ and nproc_per_node > 1),
        # and --num_cpu_threads_per_process is not applied on that path: DeepSpeed's CPU Adam would run
        # on one core per rank. Each rank gets its share of the machine's cores.
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(max(1, cores // topo.processes_per_machine))
    if topo.cpu:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed would guess the CPU anyway, with a warning
        if recipe.deepspeed is None and topo.num_processes > 1:
            # accelerate starts one process for MULTI_CPU; GPU types with this flag start N on gloo
            env["ACCELERATE_USE_CPU"] = "true"
    return env


def launch_command(script: str, topo: Topology, cores: int, extra=()) -> list[str]:
    """`accelerate launch` run from inside the run folder."""
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    words = [accelerate, "launch"] if accelerate else [sys.executable, "-m", "accelerate.commands.launch"]
    words += ["--config_file", machine_file(LAUNCH_CONFIG, topo.machine_rank)]
    if topo.cpu:  # share the cores out (accelerate warns and guesses otherwise)
        words += ["--num_cpu_threads_per_process", str(max(1, cores // topo.processes_per_machine))]
    if topo.num_machines > 1:  # c10d (the config's key is not read by launch); machine 0 hosts its store,
        # said outright rather than guessed from host names (which all match on one box)
        words += ["--rdzv_backend", "c10d", "--rdzv_conf", f"is_host={str(topo.machine_rank == 0).lower()}"]
    sft = data_dir("recipes") / f"{script}.py"
    return [*words, str(sft), "--recipe", machine_file(RECIPE, topo.machine_rank), "--output-dir", ".", *extra]


LAUNCHED_BY = "MEMRECIPE_RUN"  # in a launch's environment: started by `memrecipe run` (the loop's resume hint says so)
ERROR_LINE = b"memrecipe: error: "  # how the loop reports a RecipeError (recipes/sft.py's __main__)
TRACEBACK = b"Traceback (most recent call last)"


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

    with open(log, "a", encoding="utf-8") as sink:
        proc = subprocess.Popen(command, cwd=cwd, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            # the pipe closes when the last process of the launch (worker included) has exited
            while chunk := proc.stdout.read1(65536):
                shown, lines = output.feed(chunk)
                sys.stdout.buffer.write(shown)
                sys.stdout.buffer.flush()
                sink.writelines(line + "\n" for line in lines)
                sink.flush()
            sink.writelines(line + "\n" for line in output.finish())
            return proc.wait(), (received[0] if received else 0), output.error
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def shell_form(command: list[str], env: dict, cwd: Path) -> str:
    words = [f"{k}={shlex.quote(v)}" for k, v in env.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"]
    return f"cd {shlex.quote(str(cwd))} && " + " ".join(words + [shlex.join(command)])


RESUMABLE_KEYS = ("max_steps", "num_train_epochs")


def resumable(folder, recipe_ref, words, num_processes, machine, machine_rank=0):
    """The run folder's own recipe (only max_steps / num_train_epochs may change) and topology."""
    if folder is None:
        raise RecipeError("--resume needs the run folder: --output-dir runs/NAME")
    run = RunFolder(folder, machine_rank)
    run.lock().check()  # a run still going: say so, not that no checkpoint is complete yet
    recipe_file, launch_config = run.recipe, run.launch_config
    if not recipe_file.is_file() or not launch_config.is_file():
        raise RecipeError(f"{folder} is not a memrecipe run folder (no {recipe_file.name} / {launch_config.name})")
    if not complete_checkpoints(folder):
        raise RecipeError(f"{folder} has no complete checkpoint to resume from (the run needs save_steps)")
    r = load_recipe(str(recipe_file), words)
    changed = [key for key in differences(load_recipe(str(recipe_file)).to_dict(), r.to_dict())
               if key not in RESUMABLE_KEYS]  # the first command's words again are fine
    if changed:
        raise RecipeError(f"a resumed run keeps its recipe: {changed[0]} cannot change on --resume "
                          f"(only {' and '.join(RESUMABLE_KEYS)} can)")
    if recipe_ref and recipe_ref not in (r.name, str(recipe_file)):
        raise RecipeError(f"{folder} is a run of recipe {r.name}, not {recipe_ref}")
    config = yaml.safe_load(launch_config.read_text())
    original = config["num_processes"]
    if num_processes is not None and num_processes != original:
        raise RecipeError(f"{folder} was trained by {original} processes: resume it with --num-processes {original} "
                          "(resharding its checkpoints is not supported)")
    topo = make_topology(original, config.get("num_machines", 1), config.get("machine_rank", 0),
                         config.get("main_process_ip"), config.get("main_process_port"),
                         cpu=machine.gpus == 0, bf16=machine.bf16)
    return r, topo


def differences(before: dict, after: dict, path: str = ""):
    """The dotted keys whose values differ between two recipe dicts."""
    for key in {**before, **after}:
        old, new, here = before.get(key), after.get(key), f"{path}{key}"
        if isinstance(old, dict) and isinstance(new, dict):
            yield from differences(old, new, f"{here}.")
        elif old != new:
            yield here


def preflight(recipe):
    """Fail fast, with one line and before any folder exists: model, tokenizer, dataset columns."""
    from .data import load_source, sources
    from .modeling import EMBEDDED_MODEL, check_model, check_tokenizer, read_chat_template

    formats = set()
    for name, spec in (("train", recipe.dataset), ("eval", recipe.eval_dataset)):
        if spec or name == "train":
            for i, source in enumerate(sources(spec, recipe.dataset_format)):
                where = f"{name} dataset[{i}] ({source.path}): " if isinstance(spec, tuple) else ""
                formats.add(load_source(source, recipe.seed, where)[1])
    if recipe.chat_template:
        read_chat_template(recipe.chat_template)
    if recipe.model_name_or_path:
        check_model(recipe.model_name_or_path, recipe.trust_remote_code)
    if recipe.model_name_or_path or recipe.chat_template or "messages" in formats:
        check_tokenizer(recipe.model_name_or_path or str(EMBEDDED_MODEL), recipe.trust_remote_code,
                        recipe.chat_template, chat="messages" in formats)


def check_fits(recipe, topo, machine, words, force, shape=None):
    """The planner's verdict; a run that will not fit is refused with its breakdown and what would fit
    (a recipe of the same training method first)."""
    shape = shape or structure(read_config(recipe.model_name_or_path))
    verdict = judge(estimate(recipe, shape, topo), machine.gpu_memory, machine.host_memory or None)
    if verdict.fits or force:
        return verdict
    others = []
    for name in recipe_names():
        if name == recipe.name:
            continue
        try:
            other = load_recipe(name, words)
            check_supported(other, topo)
        except RecipeError:
            continue
        v = judge(estimate(other, shape, topo), machine.gpu_memory, machine.host_memory or None)
        if v.fits:  # the same training method first: another one trains another way
            others.append((method(other) != method(recipe), v.estimate.speed_cost, name, v.estimate.total,
                           method(other)))
    est = verdict.estimate
    loading = " (loading: every process's copy of the model)" if est.host_load >= est.host_total() else ""
    where = (f"host RAM {est.host_total() / GiB:.1f} GiB{loading} > {machine.host_memory / GiB:.1f} GiB"
             if not verdict.host_fits else f"{est.total / GiB:.1f} GiB per GPU > {machine.gpu_memory / GiB:.1f} GiB")
    if others:
        other_method, _, name, total, kind = min(others)
        instead = f"{name} would fit ({total / GiB:.1f} GiB per process)" + (
            f", a {METHODS[kind]} recipe: no {METHODS[method(recipe)]} recipe fits" if other_method else "")
    else:
        instead = "no recipe fits on this topology: more GPUs, a shorter max_seq_length, or a smaller micro batch"
    raise RecipeError(f"recipe {recipe.name} will not fit: {where} ({breakdown(est)}); {instead}; "
                      "--force launches anyway")
