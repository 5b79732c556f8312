import click

from ..report import card, load


@click.command("report")
@click.argument("run_dir", type=click.Path())
def command(run_dir):
    """Print a finished run's report card again (from its report.json)."""
    click.echo(card(load(run_dir)))
