"""What is checked before a run starts, each refusal one line: the inputs load (preflight), the run
fits (the planner's verdict, and its pick of what would fit instead), what a resume may change; and
config files, through the engines' own loaders (accelerate's config loader and launch parser,
DeepSpeed's ZeRO config model: `memrecipe validate`; they import torch, so only when called)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ..errors import RecipeError, did_you_mean
from ..layout import STATE, complete_checkpoints, lost_files
from ..planning.architecture import read_config, structure
from ..planning.hardware import Machine
from ..planning.ladder import climb
from ..planning.paths import PATH_KEYS
from ..planning.planner import breakdown, decide_dropout, judge_each, recommend
from ..planning.recipe import METHODS, method
from ..planning.registry import load_recipe, recipe_names
from ..planning.states import rank0_loads
from ..planning.topology import Topology, check_heads, make_topology
from ..units import GiB
from .run_folder import RunFolder

RESUMABLE_KEYS = ("max_steps", "num_train_epochs")


def preflight(recipe, dry_run: bool = False) -> list[str]:
    """Fail fast, with one line and before any folder exists: model, tokenizer, dataset columns. A dry run of a model
    folder with only its config.json (the weights not downloaded yet) checks everything the folder allows and returns
    what it could not check."""
    from ..planning.paths import config_only, has_tokenizer
    from ..planning.registry import EMBEDDED_MODEL
    from ..training.data import check_targets, load_sources
    from ..training.loading import check_model
    from ..training.tokenizer import check_tokenizer, read_chat_template

    sources, chat = [], False  # (where, rows, format) of each source of the train and eval data
    splits = [(name, spec) for name, spec in (("train", recipe.dataset), ("eval", recipe.eval_dataset))
              if spec or name == "train"]
    pair_sets = []  # (where, pairs) of the train and eval data under run dpo
    if recipe.dpo is not None:  # preference pairs: their columns and values (load_pairs checks them)
        from ..training.preference import check_pair_lengths, load_pairs

        for name, spec in splits:
            pairs = load_pairs(spec, recipe, name)
            chat = chat or (len(pairs) > 0 and not isinstance(pairs[0]["chosen"], str))
            pair_sets.append((f"{name} dataset: ", pairs))
        splits = []
    for name, spec in splits:
        for i, (source, raw, fmt, _) in enumerate(load_sources(spec, recipe, name)):
            where = f"{name} dataset[{i}] ({source.path}): " if isinstance(spec, tuple) else f"{name} dataset: "
            sources.append((where, raw, fmt))
    if recipe.chat_template:
        read_chat_template(recipe.chat_template)
    if recipe.model_name_or_path:
        check_model(recipe.model_name_or_path, recipe.trust_remote_code)
    unchecked = []
    if dry_run and config_only(recipe.model_name_or_path):
        unchecked.append(f"{recipe.model_name_or_path} has a config.json and no weights yet: the dry run checked "
                         "everything else (a run needs them)")
    if dry_run and not has_tokenizer(recipe.model_name_or_path):
        unchecked.append(f"{recipe.model_name_or_path} has no tokenizer yet: the examples' lengths and the chat "
                         "template were not checked against it")
        return unchecked
    tokenizer = check_tokenizer(recipe.model_name_or_path or str(EMBEDDED_MODEL), recipe.trust_remote_code,
                                recipe.chat_template, chat=chat or any(fmt == "messages" for _, _, fmt in sources))
    for where, raw, fmt in sources:  # examples too long for max_seq_length: known before launch
        check_targets(raw, fmt, tokenizer, recipe, where)
    for where, pairs in pair_sets:  # and pairs too long for dpo.max_length
        check_pair_lengths(pairs, tokenizer, recipe, where)
    return unchecked


def deepspeed_builds(recipe, topo: Topology) -> list[str]:
    """What DeepSpeed will compile before the first step, not built yet on this machine: its CPU Adam (an offloaded
    optimizer) and, for several CPU processes, its shared-memory collectives. Each is ~1-3 minutes of silence on 2
    cores the first time, then loads in seconds from the extensions folder. Compiling needs a C++ compiler, ninja
    and the Python headers: without them, one line naming what is missing."""
    import shutil
    import sys
    import sysconfig

    if recipe.deepspeed is None:
        return []
    ops = {"cpu_adam": "its CPU Adam"} if recipe.deepspeed.offload_optimizer != "none" else {}
    if topo.cpu and topo.num_processes > 1:
        ops["deepspeed_shm_comm"] = "its shared-memory collectives for CPU processes"
    folder = extensions_folder()
    missing = {name: what for name, what in ops.items() if not any((folder / name).glob("*.so"))}
    if not missing:
        return []
    lacking = [tool for tool, found in (("a C++ compiler (g++)", shutil.which("c++") or shutil.which("g++")),
                                        ("ninja (pip install ninja)", shutil.which("ninja")),
                                        ("the Python headers (python3-dev)",
                                         (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file()))
               if not found]
    if lacking:
        raise RecipeError(f"DeepSpeed compiles {' and '.join(missing.values())} on first use, and this machine lacks "
                          f"{', '.join(lacking)} (for {sys.executable}): install it, or use a recipe without "
                          "DeepSpeed's offload (e.g. fsdp)")
    return [f"DeepSpeed compiles {' and '.join(missing.values())} before the first step: once, ~1-3 minutes without "
            f"output on a few cores, kept in {folder}"]


def extensions_folder() -> Path:
    """Where torch's JIT extensions (DeepSpeed's ops) are built: TORCH_EXTENSIONS_DIR, else
    ~/.cache/torch_extensions/py<version>_<cpu|cuXY> (torch.utils.cpp_extension._get_build_directory, torch 2.13)."""
    import os
    import sys

    import torch

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import get_default_build_root

    cuda = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}_{cuda}"


def check_fits(recipe, topo: Topology, machine: Machine, words, force, shape=None):
    """(the recipe as it will run, the planner's verdict): `lora.redraw_dropout: auto` decided by this machine's
    memory (planner.decide_dropout), for the run folder's recipe.yaml to say. A run that will not fit is refused with
    its breakdown and the planner's pick of what would fit (planner.recommend): among the recipes of the same training
    method first, since another method trains another way."""
    shape = shape or structure(read_config(recipe.model_name_or_path))
    check_heads(recipe.sequence_group(topo.num_processes), shape.heads, shape.kv_heads)
    recipe, verdict = decide_dropout(recipe, shape, topo, machine.gpu_memory, machine.host_memory or None)
    if verdict.estimate.refused:  # wrong results, not too little memory: --force does not launch it
        raise RecipeError(f"recipe {recipe.name}: {verdict.estimate.refused}")
    if verdict.fits or force:
        return recipe, verdict
    est = verdict.estimate
    copies = "rank 0's copy" if rank0_loads(recipe) else "every process's copy"
    loading = f" (loading: {copies} of the model)" if est.host_load >= est.host_total() else ""
    where = (f"host RAM {est.host_total() / GiB:.1f} GiB{loading} > {machine.host_memory / GiB:.1f} GiB"
             if not verdict.host_fits else f"{est.total / GiB:.1f} GiB per GPU > {machine.gpu_memory / GiB:.1f} GiB")
    climbed, rung, fits = climb(recipe, shape, topo, machine.gpu_memory, machine.host_memory or None)
    if fits and rung.words:  # the same recipe a rung up the activation ladder fits: the cheapest change
        up = decide_dropout(climbed, shape, topo, machine.gpu_memory, machine.host_memory or None)[1].estimate
        raise RecipeError(f"recipe {recipe.name} will not fit: {where} ({breakdown(est)}); with {rung.name} it "
                          f"would ({up.total / GiB:.1f} GiB per process, host RAM {up.host_total() / GiB:.1f} GiB): add "
                          f"{' '.join(rung.words)}; --force launches anyway")
    others = []
    for name in recipe_names():
        try:
            others.append(load_recipe(name, words))
        except RecipeError:  # the run's words do not apply to it
            continue
    judged = {r.name: (method(r), v) for r, v, _ in
              judge_each(others, {r.model_name_or_path: shape for r in others}, topo, machine.gpu_memory,
                         machine.host_memory or None)[0]}
    same, why = recommend([v for m, v in judged.values() if m == method(recipe)])
    best, why = (same, why) if same else recommend([v for _, v in judged.values()])
    if best:
        kind = judged[best.estimate.recipe][0]
        instead = f"{best.estimate.recipe} would fit ({best.estimate.total / GiB:.1f} GiB per process)" + (
            f", a {METHODS[kind]} recipe: no {METHODS[method(recipe)]} recipe fits" if not same else "")
    else:
        instead = why  # nothing fits: what comes closest
    square = "".join(f"; {note}" for note in est.notes if note.startswith(f"attention: {est.attention} keeps"))
    raise RecipeError(f"recipe {recipe.name} will not fit: {where} ({breakdown(est)}); {instead}{square}; "
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
    checkpoints = complete_checkpoints(folder)
    if not checkpoints:
        raise RecipeError(f"{folder} has no complete checkpoint to resume from (the run needs save_steps)")
    check_whole(checkpoints)
    r = load_recipe(str(recipe_file), words)
    changed = [key for key in differences(load_recipe(str(recipe_file)).to_dict(), r.to_dict())
               if key not in RESUMABLE_KEYS]  # the first command's words again are fine
    if changed:
        raise RecipeError(f"a resumed run keeps its recipe: {changed[0]} cannot change on --resume "
                          f"(only {' and '.join(RESUMABLE_KEYS)} can)")
    trained = json.loads((checkpoints[-1] / STATE).read_text()).get("recipe")  # what the checkpoint was trained as
    # (not paths: read from where the file is; not mixed_precision: the launch config's wins, and the folder's
    # recipe says the one that ran)
    edited = [key for key in differences(trained, r.to_dict()) if key not in (*RESUMABLE_KEYS, "mixed_precision")
              and key.split(".")[0] not in PATH_KEYS] if trained else []
    if edited:
        raise RecipeError(f"{recipe_file} says {edited[0]}: {lookup(r.to_dict(), edited[0])!r}, and "
                          f"{checkpoints[-1].name} was trained with {lookup(trained, edited[0])!r}: its weights cannot "
                          f"load into the other shape; put {edited[0]} back to resume")
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


def check_whole(checkpoints: list[Path]) -> None:
    """The newest checkpoint still holds every file it was written with; else one line naming the lost file and the
    newest whole checkpoint, and nothing in the folder is changed."""
    newest = checkpoints[-1]
    lost = lost_files(newest)
    if not lost:
        return
    whole = next((c for c in reversed(checkpoints[:-1]) if not lost_files(c)), None)
    after = (f"the newest whole checkpoint is {whole.name}: move {newest} out of checkpoints/ to resume from it"
             if whole else "no other checkpoint is whole: start the run again")
    raise RecipeError(f"{newest.name}/{lost[0]} is missing or cut short"
                      + (f" (and {len(lost) - 1} more of its files)" if len(lost) > 1 else "") + f"; {after}")


def lookup(recipe: dict | None, dotted: str):
    for part in dotted.split("."):
        recipe = (recipe or {}).get(part)
    return recipe


def differences(before: dict, after: dict, path: str = ""):
    """The dotted keys whose values differ between two recipe dicts."""
    for key in {**before, **after}:
        old, new, here = before.get(key), after.get(key), f"{path}{key}"
        if isinstance(old, dict) and isinstance(new, dict):
            yield from differences(old, new, f"{here}.")
        elif old != new:
            yield here


def check_accelerate_config(path: Path) -> str:
    """Load with accelerate's own loader; nested keys must be `accelerate launch` options. Returns a summary."""
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    try:
        cfg = load_config_from_file(str(path))
    except (ValueError, TypeError) as e:
        raise RecipeError(f"{path}: accelerate refuses it: {' '.join(str(e).split())}") from None
    if not isinstance(cfg, ClusterConfig):
        raise RecipeError(f"{path}: a SageMaker config (compute_environment AMAZON_SAGEMAKER): memrecipe writes and "
                          "checks LOCAL_MACHINE configs (memrecipe config)")
    options = {a.dest for a in launch_command_parser()._actions}
    for section, prefix in (("fsdp_config", "fsdp_"), ("deepspeed_config", "")):
        for key in getattr(cfg, section) or {}:
            dest = key if key.startswith(prefix) else prefix + key
            if dest not in options:
                known = sorted(o for o in options if o.startswith(prefix or "zero") or o.startswith("deepspeed"))
                raise RecipeError(f"{path}: unknown key {section}.{key}{did_you_mean(dest, known)}")
    ds_file = (cfg.deepspeed_config or {}).get("deepspeed_config_file")
    if ds_file:
        target = Path(ds_file)
        if not target.is_file() and (path.parent / target.name).is_file():
            target = path.parent / target.name
        if not target.is_file():
            raise RecipeError(f"{path}: deepspeed_config_file {ds_file} does not exist (paths are relative to "
                              "the folder you run accelerate launch from)")
        check_deepspeed_json(target)
    return f"{cfg.distributed_type.value}, {cfg.num_processes} process(es) on {cfg.num_machines} machine(s)"


def check_deepspeed_json(path: Path) -> str:
    """The zero_optimization section through DeepSpeed's own config model; no train_batch_size."""
    from pydantic import ValidationError

    from ..training.device import quiet_deepspeed

    quiet_deepspeed()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        cfg = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise RecipeError(f"{path} is not readable JSON: {e}") from None
    if "train_batch_size" in cfg:
        raise RecipeError(f"{path}: train_batch_size assumes a world size; set train_micro_batch_size_per_gpu "
                          "and gradient_accumulation_steps instead")
    try:
        zero = DeepSpeedZeroConfig(**cfg.get("zero_optimization", {}))
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise RecipeError(f"{path}: zero_optimization.{where}: {err['msg']}") from None
    return f"DeepSpeed ZeRO stage {int(zero.stage)}"
