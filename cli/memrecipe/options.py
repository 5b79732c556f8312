"""Click options shared by several commands: the same flags, spelled the same, everywhere."""

from __future__ import annotations

import click


def topology_options(f):
    """--num-processes, --num-machines, --machine-rank, --main-process-ip, --main-process-port, --cpu."""
    options = [
        click.option("--num-processes", type=int, default=None, help="Total processes over all machines (= GPUs)."),
        click.option("--num-machines", type=int, default=1, show_default=True, help="Machines taking part."),
        click.option("--machine-rank", type=int, default=0, show_default=True, help="This machine's index."),
        click.option("--main-process-ip", default=None, help="Address of machine rank 0 (multi-machine)."),
        click.option("--main-process-port", type=int, default=None, help="Rendezvous port on machine rank 0."),
        click.option("--cpu", is_flag=True, help="CPU smoke-test mode: gloo processes, no GPU."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


overrides_argument = click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")


model_option = click.option("--model", default=None,
                            help="Hub id or local folder (default: the recipe's, or the embedded tiny model).")
dataset_option = click.option("--dataset", default=None,
                              help="Hub id or .jsonl/.json/.parquet/.csv file (default: the recipe's, or the embedded one).")
