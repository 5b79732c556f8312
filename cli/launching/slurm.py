"""Recipe x nodes -> an sbatch script that launches the shared loop on every node. Pure: text out.

One `accelerate launch` per node (srun, one task per node) with the recipe's generated config;
the node's rank and the head node's address come from Slurm at run time and replace the
config's placeholders on the command line. torch's c10d rendezvous runs on the head node.
"""

from __future__ import annotations

import shlex

HEAD = "HEAD_NODE"  # placeholder for main_process_ip in the config: the script passes the real address


def sbatch_script(recipe_name: str, folder: str, config_file: str, recipe_file: str, nodes: int, per_node: int,
                  port: int, partition: str | None = None, time: str | None = None, overrides=(),
                  regenerate: str = "", cpu: bool = False, cpu_env: bool = False, cpus_per_gpu: int = 8) -> str:
    """The sbatch script: submitted as is with `sbatch FILE`, from anywhere (it changes to `folder`).
    `cpu`: the CPU smoke-test form (per_node gloo processes, no GPUs asked for); `cpu_env`: its
    launches need ACCELERATE_USE_CPU (all but DeepSpeed, see generator.Invocation). On GPUs the one
    task per node asks for `cpus_per_gpu` cores per GPU: without it Slurm gives the task one core, and
    all ranks, their data loading and DeepSpeed's CPU Adam would share it."""
    sbatch = [f"--job-name=memrecipe-{recipe_name}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    sbatch += [f"--cpus-per-task={per_node}"] if cpu else [f"--gpus-per-node={per_node}",
                                                           f"--cpus-per-task={per_node * cpus_per_gpu}"]
    sbatch += [f"--partition={partition}"] if partition else []
    sbatch += [f"--time={time}"] if time else []
    sbatch.append(f"--output={folder}/%x-%j.out")
    unit = "CPU process(es)" if cpu else "GPU(s)"
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
        'export RUN_DIR="runs/' + recipe_name + '-${SLURM_JOB_ID}"',
        *(["export ACCELERATE_USE_CPU=true  # CPU smoke-test form: gloo processes stand in for GPUs"] if cpu_env else []),
        "# srun no longer inherits sbatch's --cpus-per-task (Slurm >= 22.05): pass it on. Each process gets its",
        "# share of the cores (torchrun would set 1 thread per process, starving DeepSpeed's CPU Adam).",
        'export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-$(nproc)}"  # outside an allocation: this machine\'s',
        'export OMP_NUM_THREADS="$(( SRUN_CPUS_PER_TASK / PROCESSES_PER_NODE > 0 ? SRUN_CPUS_PER_TASK / PROCESSES_PER_NODE : 1 ))"',
        "",
        "# One launcher per node, each starting PROCESSES_PER_NODE processes. SLURM_NODEID is the node's",
        "# machine rank; the command line replaces the config's placeholder rank and address. Node 0",
        "# hosts the rendezvous store (said outright: torch otherwise guesses it from host names).",
        "srun --ntasks-per-node=1 bash -c '",
        f"  accelerate launch --config_file {shlex.quote(config_file)} \\",
        '    --num_machines "$SLURM_NNODES" --num_processes "$((SLURM_NNODES * PROCESSES_PER_NODE))" \\',
        '    --machine_rank "$SLURM_NODEID" --main_process_ip "$MAIN_PROCESS_IP" --main_process_port "$MAIN_PROCESS_PORT" \\',
        '    --rdzv_backend c10d --rdzv_conf "is_host=$([ "$SLURM_NODEID" = 0 ] && echo true || echo false)" \\',
        f'    sft.py --recipe {shlex.quote(recipe_file)} --output-dir "$RUN_DIR" "$@"',
        "' memrecipe-node" + "".join(f" {shlex.quote(word)}" for word in overrides),  # the overrides, as "$@"
    ]
    return "\n".join(lines) + "\n"
