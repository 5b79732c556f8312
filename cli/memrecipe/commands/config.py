import click

from ..files import write_files
from ..options import overrides_argument, topology_options
from ..planning.configs import generate
from ..planning.registry import written_recipe
from ..planning.topology import check_supported, make_topology


@click.command("config")
@click.argument("recipe")
@topology_options
@click.option("--output-dir", default=None, help="Write the files here instead of printing them.")
@click.option("--force", is_flag=True, help="Overwrite existing files in --output-dir.")
@overrides_argument
def command(recipe, num_processes, num_machines, machine_rank, main_process_ip, main_process_port, cpu,
            output_dir, force, overrides):
    """Write RECIPE's accelerate config (+ DeepSpeed JSON) for a topology.

    \b
    memrecipe config zero3-offload --num-processes 8
    memrecipe config fsdp --cpu --num-processes 2 --output-dir configs
    memrecipe config single-gpu-lora max_seq_length=1024 lora.r=8
    """
    r = written_recipe(recipe, overrides)  # the recipe's own numbers: the embedded model's apply when a run uses it
    if num_processes is None:
        num_processes = max(r.supports.min_processes, 1)
    topo = make_topology(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, cpu)
    check_supported(r, topo)
    resolved = None
    if overrides:  # the Run line must train what the configs were written for: the recipe with the overrides
        folder = (output_dir or "").rstrip("/")
        resolved = f"{r.name}.yaml"
        recipe_file = f"{folder}/{resolved}" if folder not in ("", ".") else resolved
    files = generate(r, topo, output_dir or "", recipe_ref=recipe, overrides=overrides,
                     **({"recipe_file": recipe_file} if resolved else {}))
    if resolved:
        files[resolved] = (f"# Recipe {r.name} with {' '.join(overrides)}, resolved by memrecipe config: the "
                           f"Run line of its configs trains this.\n{r.to_yaml()}")
    if output_dir is None:
        for i, (name, text) in enumerate(files.items()):
            if len(files) > 1:
                click.echo(f"{'' if i == 0 else chr(10)}==> {name} <==")
            click.echo(text, nl=False)
        return
    for path in write_files(output_dir, files, force):
        click.echo(f"wrote {path}")
