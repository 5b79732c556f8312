from pathlib import Path

import click

from ..errors import RecipeError
from ..planning.paths import check_paths
from ..planning.registry import read_with_bases, read_yaml
from ..planning.rules import make_recipe


@click.command("validate")
@click.argument("file", type=click.Path(path_type=Path))
def command(file):
    """Check a recipe, an accelerate config or a DeepSpeed JSON."""
    if not file.is_file():
        raise RecipeError(f"{file} does not exist")
    if file.suffix == ".json":
        from ..launching.checks import check_deepspeed_json

        click.echo(f"ok: {file} ({check_deepspeed_json(file)})")
        return
    data = read_yaml(file)
    if "compute_environment" in data or "num_processes" in data:
        from ..launching.checks import check_accelerate_config

        click.echo(f"ok: {file} is an accelerate config ({check_accelerate_config(file)})")
        return
    try:
        recipe = make_recipe(read_with_bases(file))
        check_paths(recipe)
    except RecipeError as e:
        raise RecipeError(f"{file}: {e}") from None
    based = f", based on {data['base']}" if "base" in data else ""
    click.echo(f"ok: {file} is a valid recipe ({recipe.name}{based})")
