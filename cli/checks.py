"""What is checked before a run starts, each refusal one line: the inputs load (preflight), the run
fits (the planner's verdict, and its pick of what would fit instead), and what a resume may change."""

from __future__ import annotations

import yaml

from .architecture import read_config, structure
from .checkpoint import complete_checkpoints
from .errors import RecipeError
from .hardware import Machine
from .planner import METHODS, breakdown, estimate, judge, method, recommend
from .registry import load_recipe, recipe_names
from .run_folder import RunFolder
from .topology import Topology, check_supported, make_topology
from .units import GiB

RESUMABLE_KEYS = ("max_steps", "num_train_epochs")


def preflight(recipe):
    """Fail fast, with one line and before any folder exists: model, tokenizer, dataset columns."""
    from .data import check_targets, load_sources
    from .modeling import EMBEDDED_MODEL, check_model, check_tokenizer, read_chat_template

    sources = []  # (where, rows, format) of each source of the train and eval data
    for name, spec in (("train", recipe.dataset), ("eval", recipe.eval_dataset)):
        if spec or name == "train":
            for i, (source, raw, fmt, _) in enumerate(load_sources(spec, recipe, name)):
                where = f"{name} dataset[{i}] ({source.path}): " if isinstance(spec, tuple) else f"{name} dataset: "
                sources.append((where, raw, fmt))
    if recipe.chat_template:
        read_chat_template(recipe.chat_template)
    if recipe.model_name_or_path:
        check_model(recipe.model_name_or_path, recipe.trust_remote_code)
    tokenizer = check_tokenizer(recipe.model_name_or_path or str(EMBEDDED_MODEL), recipe.trust_remote_code,
                                recipe.chat_template, chat=any(fmt == "messages" for _, _, fmt in sources))
    for where, raw, fmt in sources:  # examples too long for max_seq_length: known before launch
        check_targets(raw, fmt, tokenizer, recipe, where)


def check_fits(recipe, topo: Topology, machine: Machine, words, force, shape=None):
    """The planner's verdict; a run that will not fit is refused with its breakdown and the planner's
    pick of what would fit (planner.recommend): among the recipes of the same training method first,
    since another method trains another way."""
    shape = shape or structure(read_config(recipe.model_name_or_path))
    verdict = judge(estimate(recipe, shape, topo), machine.gpu_memory, machine.host_memory or None)
    if verdict.fits or force:
        return verdict
    others = {}  # recipe name -> (its training method, its verdict)
    for name in recipe_names():
        try:
            other = load_recipe(name, words)
            check_supported(other, topo)
            others[name] = method(other), judge(estimate(other, shape, topo), machine.gpu_memory,
                                                machine.host_memory or None)
        except RecipeError:
            continue
    same, why = recommend([v for m, v in others.values() if m == method(recipe)])
    best, why = (same, why) if same else recommend([v for _, v in others.values()])
    est = verdict.estimate
    loading = " (loading: every process's copy of the model)" if est.host_load >= est.host_total() else ""
    where = (f"host RAM {est.host_total() / GiB:.1f} GiB{loading} > {machine.host_memory / GiB:.1f} GiB"
             if not verdict.host_fits else f"{est.total / GiB:.1f} GiB per GPU > {machine.gpu_memory / GiB:.1f} GiB")
    if best:
        kind = others[best.estimate.recipe][0]
        instead = f"{best.estimate.recipe} would fit ({best.estimate.total / GiB:.1f} GiB per process)" + (
            f", a {METHODS[kind]} recipe: no {METHODS[method(recipe)]} recipe fits" if not same else "")
    else:
        instead = why  # nothing fits: what comes closest
    raise RecipeError(f"recipe {recipe.name} will not fit: {where} ({breakdown(est)}); {instead}; "
                      "--force launches anyway")


def resumable(folder, recipe_ref, words, num_processes, machine: Machine, machine_rank=0):
    """The run folder's own recipe (only max_steps / num_train_epochs may change) and topology."""
    if folder is None:
        raise RecipeError("--resume needs the run folder: --output-dir runs/NAME")
    run = RunFolder(folder, machine_rank)
    run.lock().check()  # a run still going: say so, not that no checkpoint is complete yet
    recipe_file, launch_config = run.recipe, run.launch_config
    if not recipe_file.is_file() or not launch_config.is_file():
        raise RecipeError(f"{folder} is not a memrecipe run folder (no {recipe_file.name} / {launch_config.name})")
    if not complete_checkpoints(folder):
        raise RecipeError(f"{folder} has no complete checkpoint to resume from (the run needs save_steps)")
    r = load_recipe(str(recipe_file), words)
    changed = [key for key in differences(load_recipe(str(recipe_file)).to_dict(), r.to_dict())
               if key not in RESUMABLE_KEYS]  # the first command's words again are fine
    if changed:
        raise RecipeError(f"a resumed run keeps its recipe: {changed[0]} cannot change on --resume "
                          f"(only {' and '.join(RESUMABLE_KEYS)} can)")
    if recipe_ref and recipe_ref not in (r.name, str(recipe_file)):
        raise RecipeError(f"{folder} is a run of recipe {r.name}, not {recipe_ref}")
    config = yaml.safe_load(launch_config.read_text())
    original = config["num_processes"]
    if num_processes is not None and num_processes != original:
        raise RecipeError(f"{folder} was trained by {original} processes: resume it with --num-processes {original} "
                          "(resharding its checkpoints is not supported)")
    topo = make_topology(original, config.get("num_machines", 1), config.get("machine_rank", 0),
                         config.get("main_process_ip"), config.get("main_process_port"),
                         cpu=machine.gpus == 0, bf16=machine.bf16)
    return r, topo


def differences(before: dict, after: dict, path: str = ""):
    """The dotted keys whose values differ between two recipe dicts."""
    for key in {**before, **after}:
        old, new, here = before.get(key), after.get(key), f"{path}{key}"
        if isinstance(old, dict) and isinstance(new, dict):
            yield from differences(old, new, f"{here}.")
        elif old != new:
            yield here
