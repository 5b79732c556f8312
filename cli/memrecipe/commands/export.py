from pathlib import Path

import click

from ..export import EXPORT_DTYPES, export


@click.command("export")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.argument("output", type=click.Path(path_type=Path))
@click.option("--checkpoint", default=None, help="A checkpoint of the run (step-N) instead of its final save.")
@click.option("--merge", is_flag=True, help="Fold the LoRA adapter into the base weights: one standalone model.")
@click.option("--dtype", type=click.Choice(EXPORT_DTYPES), default="fp32", show_default=True)
def command(run_dir, output, checkpoint, merge, dtype):
    """Turn a run's final save or a checkpoint into a Hugging Face model folder.

    RUN_DIR is a run folder, or its final/ or checkpoints/step-N.

    \b
    memrecipe export runs/single-gpu-lora-20261122-010000 merged/ --merge
    memrecipe export runs/zero3-offload-20261122-010000 model/ --checkpoint step-200 --dtype bf16
    memrecipe export runs/zero3-offload-20261122-010000/checkpoints/step-200 model/
    """
    if not run_dir.is_dir():
        from ..errors import RecipeError

        raise RecipeError(f"{run_dir} does not exist")
    click.echo(f"wrote {export(run_dir, output, checkpoint, merge, dtype)}")
