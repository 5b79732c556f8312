import json
from dataclasses import dataclass, replace

import click

from ..errors import RecipeError
from ..options import overrides_argument
from ..planning.architecture import read_config, structure
from ..planning.forecast import REFERENCE, Rates, gpu_rates
from ..planning.gpus import gpu_named
from ..planning.positions import known_positions, positions_note
from ..planning.hardware import Machine
from ..planning.ladder import Rung, climb, longest_per_recipe, tokens, with_words
from ..planning.planner import CATEGORIES, judge_each, recommend, recommend_by_method
from ..planning.recipe import METHODS, Recipe, method
from ..planning.registry import flag_overrides, load_recipe, parse_overrides, recipe_names
from ..planning.topology import check_supported, make_topology
from ..table import table
from ..units import GiB, parse_size


SAID_NOTES = ("attention:", "lean_norms:", "lora.redraw_dropout:")  # the plan's notes printed under its table
ONE_ROW = "per_device_train_batch_size=1"


@click.command("plan")
@click.option("--model", default=None, help="Hub id (config.json only is fetched) or local folder; default: the recipe's.")
@click.option("--recipe", default=None, help="Plan one recipe (default: all of them, with a recommendation).")
@click.option("--num-processes", type=int, default=None, help="Total processes = GPUs (default: this machine's, or 1).")
@click.option("--num-machines", type=int, default=1, show_default=True)
@click.option("--gpu", default=None, help="The GPU by name, e.g. H100, H200, A100-40GB, L40S, RTX-4090: its memory as "
              "CUDA shows it and its rates for the step-time forecast (memrecipe's GPU table; --gpu-memory for any "
              "other, forecast on an H100).")
@click.option("--gpu-memory", default=None, help="Per GPU, e.g. 24GiB or 80GB (default: --gpu's, or the detected GPU).")
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
def command(model, recipe, num_processes, num_machines, gpu, gpu_memory, host_memory, global_batch, only, cpu,
            longest, as_json, plot, overrides):
    """Estimate the memory and step time of each recipe before launch, and pick one.

    \b
    memrecipe plan --model meta-llama/Llama-3.1-8B --gpu-memory 24GiB
    memrecipe plan --model ./my-model --num-processes 8 --gpu-memory 80GB --global-batch 256 max_seq_length=4096
    memrecipe plan --recipe zero3-offload --gpu-memory 24GiB --host-memory 256GiB --plot plan.png
    memrecipe plan --model meta-llama/Llama-3.1-8B --gpu H100 --longest --method qlora lora.r=32
    """
    machine = Machine.from_nvidia_smi()
    gpu_name, named_size, rates = gpu_flags(gpu, gpu_memory, cpu)
    words = [*overrides, *flag_overrides(model=model)]  # (the recipe and its words checked before the machine)
    named, refused = load_all([recipe] if recipe else recipe_names(), words, one=recipe is not None)
    gpu, host = memories(machine, named_size, host_memory, cpu)
    if global_batch is not None and global_batch < 1:
        raise RecipeError(f"--global-batch must be >= 1, got {global_batch}")
    n = num_processes if num_processes is not None else (machine.gpus * num_machines if machine.gpus and not cpu
                                                         else num_machines)  # 0 is refused, not "detect"
    topo = make_topology(n, num_machines, 0, "planned" if num_machines > 1 else None, None, cpu)
    named = [(name, r) for name, r in named if only is None or method(r) == only]
    shapes = {m: structure(read_config(m)) for m in {r.model_name_or_path for _, r in named}}
    if longest:
        return echo_longest(named, shapes, topo, gpu, host, as_json, rates)
    p = plan_all(named, refused, words, shapes, topo, gpu, host, global_batch, recipe, rates)
    asked = list(overrides)  # the words of the job planned (run_line)
    if not any(v.fits for _, v, _ in p.rows) and not global_batch and "per_device_train_batch_size" not in \
            parse_overrides(overrides) and any(r.per_device_train_batch_size > 1 for r in p.recipes):
        # at lengths where no recipe fits its own micro batch, the question is what fits one sequence at a time
        one = [(name, replace(r, per_device_train_batch_size=1)) for name, r in named]
        p = plan_all(one, refused, [*words, ONE_ROW], shapes, topo, gpu, host, None, recipe, rates)
        p.said.append("no recipe fits its own micro batch here: planned at micro batch 1 (per_device_train_batch_size=1)")
        asked.append(ONE_ROW)
    verdicts = [v for _, v, _ in p.rows]
    if recipe and p.skipped:  # the one recipe asked for cannot be planned: its reason is the answer
        raise RecipeError(p.skipped[0][1])
    skipped = [(name, why if recipe else why.split(":")[0]) for name, why in p.skipped]

    picks = pick_each_method(p, only, topo)
    script = "dpo" if any(r.dpo is not None for _, r in named) else "sft"  # (a dpo: section: run sft refuses it)
    commands = {m: run_line(p.how, best.estimate.recipe, asked, model, n, num_machines, script)
                for m, (best, _) in picks.items() if best}
    if as_json:
        click.echo(json.dumps({"model": model, "processes": n, "machines": num_machines, "gpu": gpu_name, "gpu_memory": gpu,
                               "host_memory": host, "estimates": [v.estimate.as_dict() | {"fits": v.fits,
                               "headroom": v.headroom, "batch": note, "method": method(r),
                               "rung": p.how[r.name][1].name if r.name in p.how else None,
                               "add": list(p.how[r.name][1].words) if r.name in p.how else []}
                               for r, v, note in p.rows],
                               "skipped": dict(skipped),
                               "recommendations": {m: {"recipe": best.estimate.recipe if best else None, "reason": why,
                                                       "command": commands.get(m)}
                                                   for m, (best, why) in picks.items()}}, indent=2))
    else:
        echo_table(p.rows, gpu, host, topo, global_batch, shapes, gpu_name)
        for name, why in skipped:
            click.echo(f"  {name}: {why}")
        for line in p.said:
            click.echo(line)
        for line in positions_lines(p.recipes):
            click.echo(line)
    if plot:
        from ..plots import plan_chart

        click.echo(f"wrote {plan_chart(verdicts, gpu, plot)}", err=True)
    if not as_json:
        click.echo("\nrecommended, for each training method (a choice of quality: the fastest recipe that fits "
                   "within it):")
        for m, (_, why) in picks.items():
            click.echo(f"  {METHODS[m]}: {why}" + (f"\n    {commands[m]}" if m in commands else ""))
    if not any(best for best, _ in picks.values()):
        raise RecipeError(recommend(verdicts)[1])  # what comes closest, over all methods


def pick_each_method(p, only, topo) -> dict:
    """Full fine-tuning, LoRA and QLoRA are a choice of quality, not interchangeable speeds: one pick for each,
    {method: (verdict or None, why)}, among every recipe that trains the method (a full recipe given a lora:
    section too: p.variants)."""
    picks = recommend_by_method([r for r, _, _ in p.rows], [v for _, v, _ in p.rows])
    if p.variants and (only in (None, "lora")) and not (picks.get("lora") or (None,))[0]:
        # no LoRA recipe fits: a full recipe with a lora: section may (ZeRO-3 + LoRA, Ulysses + LoRA)
        best, why = recommend([v for _, v, _ in p.variants])
        picks["lora"] = (best, why) if best else picks.get("lora", (best, why))
    if "qlora" in picks and picks["qlora"][0] is None and topo.num_processes > 1:
        picks["qlora"] = (None, picks["qlora"][1] + "; no multi-GPU long-context path takes QLoRA here (fsdp-qlora "
                          "neither offloads activations nor splits sequences): use LoRA")
    return picks


# a full recipe given LoRA for the LoRA recommendation: the shipped LoRA recipes' section (r 16, every linear layer)
LORA_WORDS = ("lora.r=16", "lora.target_modules=all-linear")


@dataclass
class Planned:
    recipes: list  # as planned: at the rung each climbed to (named NAME+RUNG)
    rows: list  # [(recipe, verdict, batch note)]: the table
    skipped: list  # [(name, why)]
    variants: list  # [(recipe, verdict, note)]: full recipes given a lora: section, judged for the LoRA pick only
    how: dict  # planned recipe name -> (the shipped recipe's name, the rung whose words it adds)
    said: list  # lines under the table: rungs climbed, the closest rung where none fits


def plan_all(named, refused, words, shapes, topo, gpu, host, global_batch, one, rates=None) -> Planned:
    """Every recipe judged at the rung of the activation ladder it needs, and (unless the words already say lora, or
    one recipe is asked for) each full recipe with a lora: section beside them, for the LoRA pick."""
    recipes, how, said = climbed_recipes(named, shapes, topo, gpu, host)
    rows, skipped = judge_each(recipes, shapes, topo, gpu, host, global_batch, rates)
    variants = []
    if not one and not any(w.startswith("lora") for w in words):
        lora = []
        for name, r in named:
            if method(r) != "full":
                continue
            try:
                lora.append((f"{name}+lora", replace(load_recipe(name, [*words, *LORA_WORDS]), name=f"{name}+lora")))
            except RecipeError:  # its rules take no adapters
                continue
        more, more_how, _ = climbed_recipes(lora, shapes, topo, gpu, host, LORA_WORDS)
        how |= more_how
        variants = judge_each(more, shapes, topo, gpu, host, global_batch, rates)[0]
    return Planned(recipes, rows, refused + skipped, variants, how, said)


def run_line(how, planned, overrides, model, processes, machines, script="sft") -> str:
    """The command that runs the planned job: the loop `script` (sft, or dpo for a recipe with a dpo: section), the
    shipped recipe, the user's words and the rung's."""
    name, rung = how.get(planned, (planned, None))
    added = [w for w in (rung.words if rung else ()) if w not in overrides]
    return " ".join([f"memrecipe run {script} --recipe", name, *(["--model", model] if model else []),
                     *(["--num-processes", str(processes)] if processes > 1 else []),
                     *(["--num-machines", str(machines)] if machines > 1 else []), *overrides, *added])


def gpu_flags(gpu: str | None, gpu_memory: str | None, cpu: bool = False
              ) -> tuple[str | None, int | None, Rates | None]:
    """(the GPU table's name or None, bytes per GPU or None, the step-time forecast's rates or None: the reference
    GPU's, or in CPU mode the CPU's): --gpu NAME at what CUDA shows of it, or --gpu-memory."""
    if gpu is not None and gpu_memory is not None:
        raise RecipeError(f"give --gpu {gpu} or --gpu-memory {gpu_memory}, not both: --gpu names a GPU of "
                          "memrecipe's table, --gpu-memory any size")
    if gpu is not None:
        return gpu_named(gpu).name, gpu_named(gpu).memory, None if cpu else gpu_rates(gpu_named(gpu))
    return None, parse_size(gpu_memory, "--gpu-memory") if gpu_memory else None, None


def memories(machine, gpu_memory: int | None, host_memory, cpu) -> tuple[int | None, int | None]:
    """The GPU memory (bytes: --gpu's or --gpu-memory's) and host RAM to plan for: the flags', else this machine's.
    This machine's RAM is the host's only when the GPUs planned for are this machine's (or in CPU mode): for other
    machines' GPUs an unknown host is not judged, and the output says so."""
    gpu = gpu_memory or machine.gpu_memory
    elsewhere = gpu_memory is not None and not cpu and gpu != machine.gpu_memory
    if host_memory:
        host = parse_size(host_memory, "--host-memory")
    else:
        host = None if elsewhere else machine.host_memory or None
    if gpu is None and not cpu:
        raise RecipeError("no GPU found here: give --gpu (e.g. H100) or --gpu-memory (e.g. 24GiB), or --cpu to plan "
                          "the smoke test")
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


def echo_longest(named, shapes, topo, gpu, host, as_json, rates=None):
    """`plan --longest`: each recipe's longest sequence at micro batch 1 over the rungs it can climb, and how long a
    step of it takes (the forecast at `rates`)."""
    rows, skipped = [], []
    for name, r in named:
        try:
            check_supported(r, topo)
            rows.append(longest_per_recipe(r, shapes[r.model_name_or_path], topo, gpu, host, rates))
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
                f"{row.verdict.estimate.host_total() / GiB:.1f}", seconds(row.verdict.estimate.step_seconds),
                " ".join(row.rung.words)]
               if row.verdict else ["-", "-", "-", "-", ""])] for row in rows]
    where = "CPU" if topo.cpu else "GPU"
    click.echo(f"topology: {topo.describe()}" + (f", {gpu / GiB:.1f} GiB per GPU" if gpu and not topo.cpu else "")
               + (f", {host / GiB:.0f} GiB host RAM per machine" if host else ", host RAM not checked (--host-memory)"))
    click.echo(table(["RECIPE", "METHOD", "LONGEST", "RUNG", f"{where} GiB", "HOST GiB", "S/STEP", "ADD"], body))
    click.echo("\n".join(skipped))
    past = [row for row in rows if row.seq_length and positions_note(replace(row.recipe, max_seq_length=row.seq_length),
                                                                     read_config(row.recipe.model_name_or_path))]
    if past:  # one line for the table (each length its own factor)
        known = known_positions(read_config(past[0].recipe.model_name_or_path))
        scaled = [row for row in past if row.recipe.rope_scaling]
        click.echo(f"{', '.join(row.recipe.name for row in past)}: " + (
            "the lengths pass the positions rope_scaling reaches: raise rope_scaling.factor" if scaled else
            f"the lengths pass the model's max_position_embeddings {known:,}, positions it never trained: "
            "rope_scaling.rope_type=yarn scales RoPE to them (the factor from the length's ratio)"))
    on = next((row.verdict.estimate.forecast_on for row in rows if row.verdict), "")
    click.echo(f"LONGEST: tokens per sequence at micro batch 1 (1K = 1,024 tokens), with the {where} memory and the host "
               "RAM per machine it needs there (backward's gradient buffers counted); S/STEP: a step's seconds forecast "
               f"on {on} (docs/speed.md); ADD: the key=value words that climb to its rung.")
    for row in rows:  # what no dropout would give, where it gives more (the adapters then share their inputs)
        if row.seq_length and row.recipe.lora and row.recipe.lora.dropout > 0:
            without = longest_per_recipe(with_words(row.recipe, ["lora.dropout=0"]), shapes[row.recipe.model_name_or_path],
                                         topo, gpu, host)
            if without.seq_length > row.seq_length:
                click.echo(f"{row.recipe.name}: lora.dropout=0 reaches {tokens(without.seq_length)} "
                           f"(the adapters then share their inputs: docs/long-context.md)")


def seconds(value: float) -> str:
    """A step time for the table: 0.52, 14.1, 158."""
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def run_hours(rows) -> list[str]:
    """How long each fitting recipe's run takes where the recipe says its steps (max_steps)."""
    timed = [(r, v) for r, v, _ in rows if (r.max_steps or 0) > 0 and v.fits]
    return [f"  {r.name}: {r.max_steps:,} steps, {r.max_steps * v.estimate.step_seconds / 3600:,.1f} hours forecast"
            for r, v in timed]


def positions_lines(recipes) -> list[str]:
    """What each recipe's max_seq_length asks of the model's RoPE (planning.positions), each line once."""
    return [line for line in dict.fromkeys(positions_note(r, read_config(r.model_name_or_path)) for r in recipes) if line]


def climbed_recipes(named, shapes, topo, gpu, host, words=()):
    """Each recipe at the cheapest rung of the activation ladder that fits (planning.ladder.climb), named NAME+RUNG
    where it climbed, or at the rung that comes closest when none fits: ([recipe], {planned name: (shipped name,
    rung with `words` before its own)}, [lines that say which])."""
    recipes, how, said = [], {}, []
    for name, r in named:
        base = name.removesuffix("+lora")
        try:  # (a rung this topology does not support is not climbed to)
            at, rung, fits = climb(r, shapes[r.model_name_or_path], topo, gpu, host)
        except RecipeError:  # a model the estimate refuses: judge_each says why
            at, rung, fits = r, None, False
        rung = rung and Rung(rung.name, (*words, *rung.words))
        if rung is not None and len(rung.words) > len(words):
            at = replace(at, name=f"{r.name}+{rung.name.split()[-1]}")
            said.append(f"  {at.name}: " + (f"fits with {rung.name} ({' '.join(rung.words[len(words):])}), not as "
                                             "written" if fits else f"does not fit on any rung; shown at its closest, {rung.name} "
                                             f"({' '.join(rung.words[len(words):])})"))
        how[at.name] = (base, rung or Rung("", tuple(words)))
        recipes.append(at)
    return recipes, how, said


def echo_table(rows, gpu, host, topo, global_batch, shapes, gpu_name=None):
    where = "CPU process" if topo.cpu else "GPU"
    for s in shapes.values():
        click.echo(f"model: {s.model_type}, {s.params / 1e9:.3f}B parameters, {s.layers} layers, hidden {s.hidden}"
                   + (f" ({', '.join(s.notes)})" if s.notes else ""))
    cap = f"{gpu / GiB:.1f} GiB per GPU" + (f" ({gpu_name}, as CUDA shows it)" if gpu_name else "") \
        if gpu and not topo.cpu else "host RAM only"
    click.echo(f"topology: {topo.describe()}, {cap}" + (f", {host / GiB:.0f} GiB host RAM per machine" if host else
                                                         ", host RAM not given (--host-memory): HOST is not checked")
               + "\n")
    headers = ["RECIPE", "BATCH", "PARAMS", "GRADS", "OPTIM", "ACTIV", "LOGITS", f"TOTAL/{where.split()[0]}", "HOST",
               "FITS", "S/STEP", "TOK/S"] + (["MICRO x ACC"] if global_batch else [])
    body = []
    for r, v, note in rows:
        e = v.estimate
        short = f"{'host' if topo.cpu else v.binding} " if not v.fits else ""  # which resource is short
        fits = ("yes" if v.fits else "no") + (f" ({short}{v.headroom / GiB:+.1f})" if v.headroom is not None else "")
        if e.refused:  # not a matter of memory: the note under the table says why
            fits = "refused"
        body.append([r.name, f"{e.micro_batch} x {e.seq_length}", *(f"{getattr(e, c) / GiB:.2f}" for c in CATEGORIES[:5]),
                     f"{e.total / GiB:.2f}",
                     f"{e.host_total() / GiB:.1f}", fits, seconds(e.step_seconds), f"{e.tokens_per_second:,.0f}"]
                    + ([note] if global_batch else []))
    click.echo(table(headers, body))
    for line in dict.fromkeys(n for _, v, _ in rows for n in v.estimate.notes if n.startswith(SAID_NOTES)):
        click.echo(line)  # what attn_implementation: auto resolves to here, a knob the model cannot take: as planned
    nccl = {r.name: v.estimate.nccl for r, v, _ in rows if v.estimate.nccl}
    if nccl:  # outside torch's allocator, in TOTAL
        click.echo("NCCL's buffers in TOTAL, GiB a GPU (planning/nccl.py, docs/memory.md): "
                   + ", ".join(f"{name} {b / GiB:.1f}" for name, b in nccl.items()))
    click.echo("GiB per process (HOST: per machine); TOTAL counts ACTIV and LOGITS at their joint peak (with "
               "checkpointing the loss and a layer's recompute come one after the other); FITS: spare GiB on the "
               "tightest of GPU and host" + ("; refused: it cannot run whatever the memory (the attention: line "
                                              "says why)" if any(v.estimate.refused for _, v, _ in rows) else "")
               + "; BATCH: micro batch x tokens per sequence, per process")
    on = rows[0][1].estimate.forecast_on if rows else ""
    click.echo(f"S/STEP, TOK/S: the step time forecast on {on}" + (" (--gpu NAME forecasts on yours)" if
               on == REFERENCE.name and gpu_name is None else "") + ", all processes' tokens a second "
               "(docs/speed.md: what it counts, and how close it has come)")
    for line in run_hours(rows):
        click.echo(line)
