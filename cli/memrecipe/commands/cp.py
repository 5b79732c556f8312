from pathlib import Path

import click

from ..files import write_files
from ..planning.configs import script_files, shipped_files
from ..planning.registry import load_recipe


@click.command("cp")
@click.argument("recipe")
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite files that already exist in DEST.")
def command(recipe, dest, force):
    """Copy the loop, RECIPE and its configs into DEST, to edit.

    \b
    memrecipe cp fsdp train/
    cd train && ACCELERATE_USE_CPU=true accelerate launch --config_file fsdp_cpu2.yaml sft.py --recipe fsdp.yaml
    """
    r = load_recipe(recipe)
    yaml_name = f"{r.name}.yaml"
    files = script_files(recipe, r, yaml_name)  # in DEST everything sits side by side
    files |= shipped_files(r, folder=".", recipe_ref=r.name, script="sft.py", recipe_file=yaml_name)
    for path in write_files(dest, files, force):
        click.echo(f"wrote {path}")
    click.echo(f"run from {dest}: the 'Run:' line at the top of each .yaml config (needs memrecipe installed: "
               "sft.py imports it); dpo.py in place of sft.py trains preference pairs (it imports sft.py's steps)")
