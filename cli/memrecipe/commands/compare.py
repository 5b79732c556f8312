import click

from ..plots import compare_chart
from ..report import compare_rows, load
from ..table import table


@click.command("compare")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Also draw them as bars (PNG).")
def command(run_dirs, plot):
    """Compare finished runs side by side: memory, speed, loss."""
    reports = [load(d) for d in run_dirs]
    click.echo(table(*compare_rows(reports)))
    if plot:
        click.echo(f"wrote {compare_chart(reports, plot)}", err=True)
