import json
from dataclasses import replace

import click

from ..errors import RecipeError
from ..options import overrides_argument
from ..planning.architecture import read_config, structure
from ..planning.positions import positions_note
from ..planning.hardware import Machine
from ..planning.ladder import climb, longest_per_recipe, tokens
from ..planning.planner import CATEGORIES, judge_each, recommend, recommend_by_method
from ..planning.recipe import METHODS, Recipe, method
from ..planning.registry import flag_overrides, load_recipe, recipe_names
from ..planning.topology import check_supported, make_topology
from ..table import table
from ..units import GiB, parse_size


SAID_NOTES = ("attention:", "lean_norms:")  # the plan's notes printed under its table


@click.command("plan")
@click.option("--model", default=None, help="Hub id (config.json only is fetched) or local folder; default: the recipe's.")
@click.option("--recipe", default=None, help="Plan one recipe (default: all of them, with a recommendation).")
@click.option("--num-processes", type=int, default=None, help="Total processes = GPUs (default: this machine's, or 1).")
@click.option("--num-machines", type=int, default=1, show_default=True)
@click.option("--gpu-memory", default=None, help="Per GPU, e.g. 24GiB or 80GB (default: the detected GPU).")
@click.option("--host-memory", default=None,
              help="Per machine, e.g. 512GiB (default: this machine's, unless --gpu-memory names other GPUs).")
@click.option("--global-batch", type=int, default=None, help="Sequences per optimizer step: find micro batch x accumulation.")
@click.option("--method", "only", type=click.Choice(list(METHODS)), default=None,
              help="Recommend within this training method only (default: one recommendation per method).")
@click.option("--cpu", is_flag=True, help="Plan the CPU smoke-test mode (host RAM only).")
@click.option("--longest", is_flag=True,
              help="The longest max_seq_length each recipe fits at micro batch 1, the rung it climbs to, its host RAM.")
@click.option("--json", "as_json", is_flag=True, help="Print the estimates as JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write a stacked bar chart (PNG).")
@overrides_argument
def command(model, recipe, num_processes, num_machines, gpu_memory, host_memory, global_batch, only, cpu, longest,
            as_json, plot, overrides):
    """Estimate the memory of each recipe before launch, and pick one.

    \b
    memrecipe plan --model meta-llama/Llama-3.1-8B --gpu-memory 24GiB
    memrecipe plan --model ./my-model --num-processes 8 --gpu-memory 80GB --global-batch 256 max_seq_length=4096
    memrecipe plan --recipe zero3-offload --gpu-memory 24GiB --host-memory 256GiB --plot plan.png
    memrecipe plan --model meta-llama/Llama-3.1-8B --gpu-memory 80GB --longest --method qlora lora.r=32
    """
    machine = Machine.from_nvidia_smi()
    gpu, host = memories(machine, gpu_memory, host_memory, cpu)
    if global_batch is not None and global_batch < 1:
        raise RecipeError(f"--global-batch must be >= 1, got {global_batch}")
    n = num_processes if num_processes is not None else (machine.gpus * num_machines if machine.gpus and not cpu
                                                         else num_machines)  # 0 is refused, not "detect"
    topo = make_topology(n, num_machines, 0, "planned" if num_machines > 1 else None, None, cpu)
    words = [*overrides, *flag_overrides(model=model)]
    named, refused = load_all([recipe] if recipe else recipe_names(), words, one=recipe is not None)
    named = [(name, r) for name, r in named if only is None or method(r) == only]
    recipes = [r for _, r in named]
    shapes = {m: structure(read_config(m)) for m in {r.model_name_or_path for r in recipes}}
    if longest:
        return echo_longest(named, shapes, topo, gpu, host, as_json)
    recipes, climbed = climbed_recipes(named, shapes, topo, gpu, host)

    rows, skipped = judge_each(recipes, shapes, topo, gpu, host, global_batch)
    skipped = refused + skipped
    verdicts = [v for _, v, _ in rows]
    if recipe and skipped:  # the one recipe asked for cannot be planned: its reason is the answer
        raise RecipeError(skipped[0][1])
    skipped = [(name, why if recipe else why.split(":")[0]) for name, why in skipped]

    # full fine-tuning, LoRA and QLoRA are a choice of quality, not interchangeable speeds: one pick for each
    picks = recommend_by_method([r for r, _, _ in rows], verdicts)
    if as_json:
        click.echo(json.dumps({"model": model, "processes": n, "machines": num_machines, "gpu_memory": gpu,
                               "host_memory": host, "estimates": [v.estimate.as_dict() | {"fits": v.fits,
                               "headroom": v.headroom, "batch": note, "method": method(r)} for r, v, note in rows],
                               "skipped": dict(skipped),
                               "recommendations": {m: {"recipe": best.estimate.recipe if best else None, "reason": why}
                                                   for m, (best, why) in picks.items()}}, indent=2))
    else:
        echo_table(rows, gpu, host, topo, global_batch, shapes)
        for name, why in skipped:
            click.echo(f"  {name}: {why}")
        for name, rung in climbed:
            click.echo(f"  {name}: fits with {rung.name} ({' '.join(rung.words)}), not as written")
        for line in positions_lines(recipes):
            click.echo(line)
    if plot:
        from ..plots import plan_chart

        click.echo(f"wrote {plan_chart([v for _, v, _ in rows], gpu, plot)}", err=True)
    if not as_json:
        click.echo("\nrecommended, for each training method (a choice of quality: the fastest recipe that fits "
                   "within it):")
        for m, (best, why) in picks.items():
            click.echo(f"  {METHODS[m]}: {why}")
    if not any(best for best, _ in picks.values()):
        raise RecipeError(recommend(verdicts)[1])  # what comes closest, over all methods


def memories(machine, gpu_memory, host_memory, cpu) -> tuple[int | None, int | None]:
    """The GPU memory and host RAM to plan for: the flags', else this machine's. This machine's RAM is the host's
    only when the GPUs planned for are this machine's (or in CPU mode): for other machines' GPUs an unknown host is
    not judged, and the output says so."""
    gpu = parse_size(gpu_memory, "--gpu-memory") if gpu_memory else machine.gpu_memory
    elsewhere = gpu_memory is not None and not cpu and gpu != machine.gpu_memory
    if host_memory:
        host = parse_size(host_memory, "--host-memory")
    else:
        host = None if elsewhere else machine.host_memory or None
    if gpu is None and not cpu:
        raise RecipeError("no GPU found here: give --gpu-memory (e.g. 24GiB or 80GB), or --cpu to plan the smoke test")
    return gpu, host


def load_all(names, words, one: bool) -> tuple[list[tuple[str, Recipe]], list[tuple[str, str]]]:
    """([(name, recipe)], [(name, why it was left out)]): a recipe the words do not fit (e.g. a LoRA adapter as
    --model for a full fine-tune) is left out, unless it is the one asked for or none is left: then the reason is
    the answer."""
    named, refused = [], []
    for name in names:
        try:
            named.append((name, load_recipe(name, words)))
        except RecipeError as e:
            if one or len(refused) == len(names) - 1 and not named:
                raise
            refused.append((name, str(e).removeprefix(f"recipe {name}: ")))
    return named, refused


def echo_longest(named, shapes, topo, gpu, host, as_json):
    """`plan --longest`: each recipe's longest sequence at micro batch 1 over the rungs it can climb."""
    rows, skipped = [], []
    for name, r in named:
        try:
            check_supported(r, topo)
            rows.append(longest_per_recipe(r, shapes[r.model_name_or_path], topo, gpu, host))
        except RecipeError as e:  # a topology it does not support, or a model it cannot train
            skipped.append(f"  {name}: {str(e).removeprefix(f'recipe {name} ')}")
    if as_json:
        click.echo(json.dumps({"processes": topo.num_processes, "gpu_memory": gpu, "host_memory": host, "estimates": [
            (row.verdict.estimate.as_dict() if row.verdict else {"recipe": row.recipe.name})
            | {"longest_seq_length": row.seq_length, "rung": row.rung.name, "add": list(row.rung.words),
               "method": method(row.recipe)} for row in rows]}, indent=2))
        return
    body = [[row.recipe.name, METHODS[method(row.recipe)], tokens(row.seq_length) if row.seq_length else "none",
             *([row.rung.name, f"{row.verdict.estimate.total / GiB:.1f}",
                f"{row.verdict.estimate.host_total() / GiB:.1f}", " ".join(row.rung.words)]
               if row.verdict else ["-", "-", "-", ""])] for row in rows]
    where = "CPU" if topo.cpu else "GPU"
    click.echo(f"topology: {topo.describe()}" + (f", {gpu / GiB:.1f} GiB per GPU" if gpu and not topo.cpu else "")
               + (f", {host / GiB:.0f} GiB host RAM per machine" if host else ", host RAM not checked (--host-memory)"))
    click.echo(table(["RECIPE", "METHOD", "LONGEST", "RUNG", f"{where} GiB", "HOST GiB", "ADD"], body))
    click.echo("\n".join(skipped))
    for line in positions_lines([replace(row.recipe, max_seq_length=row.seq_length) for row in rows if row.seq_length]):
        click.echo(line)
    click.echo(f"LONGEST: tokens per sequence at micro batch 1 (1K = 1,024 tokens), with the {where} memory and the host "
               "RAM per machine it needs there (backward's gradient buffers counted); ADD: the key=value words that climb "
               "to its rung. lora.dropout=0 reaches further: the adapters then share their inputs (docs/long-context.md)")


def positions_lines(recipes) -> list[str]:
    """What each recipe's max_seq_length asks of the model's RoPE (planning.positions), each line once."""
    return [line for line in dict.fromkeys(positions_note(r, read_config(r.model_name_or_path)) for r in recipes) if line]


def climbed_recipes(named, shapes, topo, gpu, host):
    """Each recipe at the cheapest rung of the activation ladder that fits (planning.ladder.climb), named NAME+RUNG
    where it climbed: ([recipe], [(that name, rung)])."""
    recipes, climbed = [], []
    for name, r in named:
        try:  # (a rung this topology does not support is not climbed to)
            at, rung = climb(r, shapes[r.model_name_or_path], topo, gpu, host)
        except RecipeError:  # a model the estimate refuses: judge_each says why
            at, rung = r, None
        if rung is not None and rung.words:
            at = replace(at, name=f"{r.name}+{rung.name.split()[-1]}")
            climbed.append((at.name, rung))
        recipes.append(at)
    return recipes, climbed


def echo_table(rows, gpu, host, topo, global_batch, shapes):
    where = "CPU process" if topo.cpu else "GPU"
    for s in shapes.values():
        click.echo(f"model: {s.model_type}, {s.params / 1e9:.3f}B parameters, {s.layers} layers, hidden {s.hidden}"
                   + (f" ({', '.join(s.notes)})" if s.notes else ""))
    cap = f"{gpu / GiB:.1f} GiB per GPU" if gpu and not topo.cpu else "host RAM only"
    click.echo(f"topology: {topo.describe()}, {cap}" + (f", {host / GiB:.0f} GiB host RAM per machine" if host else
                                                         ", host RAM not given (--host-memory): HOST is not checked")
               + "\n")
    headers = ["RECIPE", "BATCH", "PARAMS", "GRADS", "OPTIM", "ACTIV", "LOGITS", f"TOTAL/{where.split()[0]}", "HOST",
               "FITS", "SPEED"] + (["MICRO x ACC"] if global_batch else [])
    body = []
    for r, v, note in rows:
        e = v.estimate
        short = f"{'host' if topo.cpu else v.binding} " if not v.fits else ""  # which resource is short
        fits = ("yes" if v.fits else "no") + (f" ({short}{v.headroom / GiB:+.1f})" if v.headroom is not None else "")
        body.append([r.name, f"{e.micro_batch} x {e.seq_length}", *(f"{getattr(e, c) / GiB:.2f}" for c in CATEGORIES[:5]),
                     f"{e.total / GiB:.2f}",
                     f"{e.host_total() / GiB:.1f}", fits, f"x{e.speed_cost}"] + ([note] if global_batch else []))
    click.echo(table(headers, body))
    for line in dict.fromkeys(n for _, v, _ in rows for n in v.estimate.notes if n.startswith(SAID_NOTES)):
        click.echo(line)  # what attn_implementation: auto resolves to here, a knob the model cannot take: as planned
    click.echo("GiB per process (HOST: per machine); TOTAL counts ACTIV and LOGITS at their joint peak (with "
               "checkpointing the loss and a layer's recompute come one after the other); FITS: spare GiB on the "
               "tightest of GPU and host; SPEED: step "
               "time vs plain bf16 on one GPU (rule of thumb); BATCH: micro batch x tokens per sequence, per process")
