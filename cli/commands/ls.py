import click

from ..recipe import processes_range, techniques
from ..registry import load_recipe, recipe_names
from ..table import table


@click.command("ls")
def command():
    """List the recipes and what each saves and costs."""
    rows = []
    for name in recipe_names():
        r = load_recipe(name)
        rows.append([name, ", ".join(techniques(r)), processes_range(r), r.saves, r.costs])
    headers = ["RECIPE", "TECHNIQUES", "PROCESSES", "SAVES", "COSTS"]
    click.echo(table(headers, rows, widths={1: 34, 3: 34, 4: 30}))
    click.echo("\nmemrecipe show RECIPE prints one with its comments; memrecipe config RECIPE writes its accelerate config.")
