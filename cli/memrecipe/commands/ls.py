import textwrap

import click

from ..planning.recipe import processes_range, techniques
from ..planning.registry import load_recipe, recipe_names
from ..table import table, terminal_width


@click.command("ls")
def command():
    """List the recipes and what each saves and costs."""
    rows = []
    for name in recipe_names():
        r = load_recipe(name)
        tested = "runs, tested" if r.cpu_blocker is None else "GPU only"
        rows.append([name, ", ".join(techniques(r)), processes_range(r), tested, r.saves, r.costs])
    headers = ["RECIPE", "TECHNIQUES", "PROCESSES", "ON CPU", "SAVES", "COSTS"]
    wide = table(headers, rows, widths={1: 30, 4: 30, 5: 28})
    width = terminal_width()
    if width and max(map(len, wide.splitlines())) > width:  # a narrow terminal: one block per recipe
        blocks = []
        for name, used, processes, tested, saves, costs in rows:
            lines = [f"{name}  (processes: {processes}; on CPU: {tested})"]
            for label, text in (("techniques", used), ("saves", saves), ("costs", costs)):
                lines += textwrap.wrap(f"{label}: {text}", width, initial_indent="  ", subsequent_indent="    ")
            blocks.append("\n".join(lines))
        wide = "\n\n".join(blocks)
    click.echo(wide)
    footer = ("ON CPU: runs end to end in CPU smoke-test mode and in the test suite; GPU only: its configs are "
              "generated and validated. memrecipe show RECIPE prints one with its comments; memrecipe config RECIPE "
              "writes its accelerate config; docs/recipes.md says when to use each.")
    click.echo("\n" + "\n".join(textwrap.wrap(footer, min(width or 120, 120))))
