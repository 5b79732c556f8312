import shlex
from pathlib import Path

import click

from ..errors import RecipeError
from ..files import write_files
from ..launching.slurm import HEAD, sbatch_script
from ..options import dataset_option, model_option, overrides_argument
from ..planning.configs import generate, launch_env, script_files
from ..planning.paths import absolute_word
from ..planning.registry import flag_overrides, load_recipe
from ..planning.topology import check_supported, make_topology


@click.command("slurm")
@click.argument("recipe")
@model_option
@dataset_option
@click.option("--nodes", type=int, required=True, help="Nodes to allocate (sbatch --nodes).")
@click.option("--gpus-per-node", type=int, required=True, help="GPUs per node (sbatch --gpus-per-node).")
@click.option("--partition", default=None, help="Slurm partition (sbatch --partition).")
@click.option("--time", default=None, help="Time limit in sbatch's format, e.g. 2-00:00:00 (sbatch --time).")
@click.option("--port", type=int, default=29500, show_default=True, help="Rendezvous port on the head node.")
@click.option("--cpus-per-gpu", type=int, default=8, show_default=True,
              help="Cores asked for per GPU (sbatch --cpus-per-task = GPUs per node x this).")
@click.option("--cpu", is_flag=True, help="CPU smoke-test form: --gpus-per-node gloo processes per node, no GPUs.")
@click.option("--output-dir", type=click.Path(path_type=Path), default=None,
              help="Folder for the script and its files (default: slurm/RECIPE-NxGgpu).")
@click.option("--force", is_flag=True, help="Overwrite existing files in --output-dir.")
@click.option("--script", type=click.Choice(["sft", "dpo"]), default="sft", show_default=True,
              help="The loop the nodes run: sft.py, or dpo.py (preference pairs).")
@overrides_argument
def command(recipe, model, dataset, nodes, gpus_per_node, partition, time, port, cpus_per_gpu, cpu, output_dir, force,
            script, overrides):
    """Write an sbatch script that trains RECIPE on NODES x GPUS-PER-NODE GPUs.

    \b
    memrecipe slurm fsdp --nodes 2 --gpus-per-node 8 --partition gpu --time 1-00:00:00 --model meta-llama/Llama-3.1-8B
    sbatch slurm/fsdp-2x8gpu/fsdp.sbatch
    memrecipe slurm fsdp-lora --nodes 1 --gpus-per-node 8 --script dpo --dataset prefs.jsonl
    """
    words = [absolute_word(w) for w in (*overrides, *flag_overrides(model=model, dataset=dataset))]
    r = load_recipe(recipe, words, script=script)
    if nodes < 1 or gpus_per_node < 1 or cpus_per_gpu < 1:
        raise RecipeError(f"--nodes, --gpus-per-node and --cpus-per-gpu must be >= 1, got {nodes}, {gpus_per_node} "
                          f"and {cpus_per_gpu}")
    topo = make_topology(nodes * gpus_per_node, nodes, 0, HEAD, port, cpu)
    check_supported(r, topo)
    folder = (output_dir or Path("slurm") / f"{r.name}-{nodes}x{gpus_per_node}{'cpu' if cpu else 'gpu'}").resolve()
    recipe_file = f"{r.name}.yaml"
    loop = f"{script}.py"
    files = generate(r, topo, ".", recipe_ref=recipe, overrides=words, script=loop, recipe_file=recipe_file)
    (config_file,) = [name for name in files if name.endswith(".yaml")]
    files |= script_files(recipe, r, recipe_file)
    regenerate = shlex.join(["memrecipe", "slurm", recipe, *(["--script", script] if script != "sft" else []),
                             "--nodes", str(nodes), "--gpus-per-node", str(gpus_per_node),
                             *(w for k, v in (("--partition", partition), ("--time", time)) if v for w in (k, v)),
                             "--port", str(port), *(["--cpu"] if cpu else ["--cpus-per-gpu", str(cpus_per_gpu)]),
                             "--output-dir", str(folder), *words])
    files[f"{r.name}.sbatch"] = sbatch_script(r.name, str(folder), config_file, recipe_file, nodes, gpus_per_node,
                                              port, partition, time, words, regenerate, cpu,
                                              env=launch_env(r, topo), cpus_per_gpu=cpus_per_gpu, loop=loop)
    for path in write_files(folder, files, force):
        click.echo(f"wrote {path}")
    click.echo(f"submit with: sbatch {folder / (r.name + '.sbatch')}   ({loop} needs memrecipe installed on the nodes)")

