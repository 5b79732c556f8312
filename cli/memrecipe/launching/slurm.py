"""Recipe x nodes -> an sbatch script that launches the shared loop on every node. Pure: text out.

One `accelerate launch` per node (srun, one task per node) with the recipe's generated config;
the node's rank and the head node's address come from Slurm at run time and replace the
config's placeholders on the command line. torch's c10d rendezvous runs on the head node.
"""

from __future__ import annotations

import re
import shlex

from ..planning.configs import launch_words
from .run_folder import run_folder_name

HEAD = "HEAD_NODE"  # placeholder for main_process_ip in the config: the script passes the real address


def sbatch_script(recipe_name: str, folder: str, config_file: str, recipe_file: str, nodes: int, per_node: int,
                  port: int, partition: str | None = None, time: str | None = None, overrides=(),
                  regenerate: str = "", cpu: bool = False, env: dict | None = None, cpus_per_gpu: int = 8,
                  loop: str = "sft.py") -> str:
    """The sbatch script: submitted as is with `sbatch FILE`, from anywhere (it changes to `folder`).
    `cpu`: the CPU smoke-test form (per_node gloo processes, no GPUs asked for); `env`: what the
    launches need in their environment (configs.launch_env). On GPUs the one
    task per node asks for `cpus_per_gpu` cores per GPU: without it Slurm gives the task one core, and
    all ranks, their data loading and DeepSpeed's CPU Adam would share it."""
    sbatch = [f"--job-name=memrecipe-{recipe_name}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    sbatch += [f"--cpus-per-task={per_node}"] if cpu else [f"--gpus-per-node={per_node}",
                                                           f"--cpus-per-task={per_node * cpus_per_gpu}"]
    sbatch += [f"--partition={partition}"] if partition else []
    sbatch += [f"--time={time}"] if time else []
    sbatch.append(f"--output={folder}/%x-%j.out")
    unit = "CPU process(es)" if cpu else "GPU(s)"
    ranks = ["--num_machines", "$SLURM_NNODES", "--num_processes", "$((SLURM_NNODES * PROCESSES_PER_NODE))",
             "--machine_rank", "$SLURM_NODEID", "--main_process_ip", "$MAIN_PROCESS_IP",
             "--main_process_port", "$MAIN_PROCESS_PORT"]
    words = launch_words(config_file, loop, recipe_file, nodes, '$([ "$SLURM_NODEID" = 0 ] && echo true || echo false)',
                         ranks, ["--output-dir", "$RUN_DIR", "$@"])
    lines = [
        "#!/bin/bash",
        f"# memrecipe recipe {recipe_name} on {nodes} node(s) x {per_node} {unit}: submit with "
        f"`sbatch {folder}/{recipe_name}.sbatch`.",
        f"# Regenerate: {regenerate}" if regenerate else "#",
        *(f"#SBATCH {option}" for option in sbatch),
        "",
        "set -euo pipefail",
        f"cd {shlex.quote(folder)}  # the loop, the recipe and the configs sit here (memrecipe slurm wrote them)",
        "# The first node of the allocation holds the rendezvous (torch c10d) that every node joins.",
        'export MAIN_PROCESS_IP="${MAIN_PROCESS_IP:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"',
        f'export MAIN_PROCESS_PORT="${{MAIN_PROCESS_PORT:-{port}}}"',
        f"export PROCESSES_PER_NODE={per_node}  # one per GPU",
        f'export RUN_DIR="{run_folder_name(recipe_name, "${SLURM_JOB_ID}")}"',
        *(f"export {key}={value}  # CPU smoke-test form: gloo processes stand in for GPUs" for key, value in (env or {}).items()),
        "# srun no longer inherits sbatch's --cpus-per-task (Slurm >= 22.05): pass it on. Each process gets its",
        "# share of the cores (torchrun would set 1 thread per process, starving DeepSpeed's CPU Adam).",
        'export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-$(nproc)}"  # outside an allocation: this machine\'s',
        'export OMP_NUM_THREADS="$(( SRUN_CPUS_PER_TASK / PROCESSES_PER_NODE > 0 ? SRUN_CPUS_PER_TASK / PROCESSES_PER_NODE : 1 ))"',
        "",
        "# One launcher per node, each starting PROCESSES_PER_NODE processes. SLURM_NODEID is the node's",
        "# machine rank; the command line replaces the config's placeholder rank and address. Node 0",
        "# hosts the rendezvous store (said outright: torch otherwise guesses it from host names).",
        "srun --ntasks-per-node=1 bash -c '",
        "  accelerate launch " + " \\\n    ".join(" ".join(_quoted(w) for w in group) for group in _grouped(words)),
        "' memrecipe-node" + "".join(f" {shlex.quote(word)}" for word in overrides),  # the overrides, as "$@"
    ]
    return "\n".join(lines) + "\n"


def _quoted(word: str) -> str:
    """A word inside the script's `bash -c '...'`: shell expansions (and anything else not plain) in double
    quotes, never single ones."""
    return word if re.fullmatch(r"[\w./:=+-]+", word) else f'"{word}"'


def _grouped(words: list[str]) -> list[list[str]]:
    """Launch words two lines at a time for the reader: the config, each option with its value, the loop."""
    groups, i = [], 0
    while i < len(words):
        if words[i].startswith("--") and i + 1 < len(words) and not words[i + 1].startswith("--"):
            groups.append(words[i:i + 2])
            i += 2
        else:
            groups.append([words[i]])
            i += 1
    return groups
