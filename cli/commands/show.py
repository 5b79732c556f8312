import click

from ..registry import load_recipe, recipe_path


@click.command("show")
@click.argument("recipe")
def command(recipe):
    """Print RECIPE's YAML (a name or a file), with its comments."""
    path = recipe_path(recipe)
    load_recipe(recipe)  # refuse a broken recipe file here rather than show it as if it worked
    click.echo(path.read_text(encoding="utf-8"), nl=False)
