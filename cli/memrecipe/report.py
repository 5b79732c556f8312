"""The run's report card: what it measured next to what the planner predicted, and what to try next.

Shared by the loop (printed at the end of a run) and `memrecipe report` / `memrecipe compare`
(which read report.json again). Pure functions over the report dict.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import RecipeError
from .launching.run_folder import RunFolder
from .layout import RECIPE
from .plots import peak_key, plot_loss
from .table import table
from .training.facts import SetupFacts
from .units import GiB

REQUIRED = ("recipe", "topology", "plan", "processes", "throughput", "history", "final_train_loss", "wall_seconds")
# Dense bf16 peak FLOP/s by device name, from NVIDIA's datasheets (no sparsity). A device not
# listed reports no MFU rather than a wrong one.
BF16_PEAK = {"H200": 989e12, "H100 SXM": 989e12, "H100 80GB HBM3": 989e12, "H100 NVL": 835e12,
             "H100 PCIe": 756e12, "H100": 756e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12,
             "L4": 121e12, "A10G": 70e12, "A10": 125e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "A6000": 155e12}


def bf16_peak(device_name: str | None) -> float | None:
    """Peak dense bf16 FLOP/s for a CUDA device name; the longest matching table key wins."""
    if not device_name:
        return None
    matches = [k for k in BF16_PEAK if k.lower() in device_name.lower()]
    return BF16_PEAK[max(matches, key=len)] if matches else None


def flops_per_token(params: int, trainable: int, layers: int, hidden: int, seq: int) -> float:
    """Model FLOPs per trained token: 6N for full fine-tuning (forward 2N, backward 4N), 4N when only
    adapters train (no weight gradients for the frozen base), plus attention's 12 x layers x hidden x seq. N: the
    parameters a token multiplies by (Structure.active_params: top_k experts, not the embedding lookup). Attention
    is counted over whole rows of `seq` tokens: an upper bound for packed rows, whose documents attend only within
    themselves (the MFU it gives reads high there)."""
    weights = 6 * params if trainable >= params else 4 * params + 2 * trainable
    return weights + 12 * layers * hidden * seq


def load(run_dir) -> dict:
    path = RunFolder(run_dir).report
    if not path.is_file():
        raise RecipeError(f"{run_dir} has no {path.name}: is it a finished memrecipe run folder?")
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(f"{path} is not valid JSON ({e.msg}): the run may have been cut off") from None
    missing = [k for k in REQUIRED if k not in report]
    if missing:
        raise RecipeError(f"{path} lacks {', '.join(missing)}: written by an older memrecipe, or not by memrecipe")
    return report | {"output_dir": str(Path(run_dir).resolve())}  # where it is now (a run folder may move)


GATHERED = {"parameters": "params", "gradients": "grads"}  # plan keys of what a sharded engine gathers per layer


def speed_lines(tput: dict) -> list[str]:
    """The card's throughput (after the warm-up), MFU, and the run against the plan's forecast."""
    mfu = f"{tput['mfu']:.1%}" if tput.get("mfu") is not None else "n/a (" + tput.get("mfu_note", "") + ")"
    padding = f", padding {tput['padding_fraction']:.0%} of the batches" if "padding_fraction" in tput else ""
    warmup = f" after the first step ({tput['warmup_seconds']:.1f} s of warm-up)" if tput.get("warmup_seconds") else ""
    lines = [f"throughput{warmup}: {tput['tokens_per_second']:,.0f} real tokens/s total, "
             f"{tput['tokens_per_second_per_process']:,.0f} per process, {tput['seconds_per_step']:.2f} s/step"
             f"{padding} | MFU {mfu}"]
    if tput.get("measured_vs_forecast"):
        lines.append(f"forecast (planning.forecast): {tput['forecast_tokens_per_second']:,.0f} tokens/s on "
                     f"{tput['forecast_on']}, padding counted; this run went {tput['measured_vs_forecast']:.2f}x that")
    return lines


def card(report: dict) -> str:
    """The report card as text: memory predicted vs measured, throughput, MFU, loss, advice."""
    plan, procs, setup = report.get("plan") or {}, report["processes"], SetupFacts.from_dict(report.get("setup", {}))
    lines = [f"memrecipe report: {report['recipe']['name']} on {report['topology']['describe']}, "
             f"{report['steps']} steps in {report['wall_seconds']:.1f} s"]
    peak = peak_key(procs[0])
    rows = []
    for label, key, measured in (
            *[(c.replace("_", " "), c, [p["held"][c] for p in procs]) for c in ("parameters", "gradients", "optimizer_state")],
            ("activations", "activations", [None for _ in procs]),
            ("logits (the loss's peak)", "logits", [p["held"].get("logits") for p in procs]),
            ("total / peak" + (" (CUDA allocated)" if peak.startswith("cuda") else " (RSS)"), "total",
             [p[peak] for p in procs])):
        planned, most = plan.get(key), max((m for m in measured if m is not None), default=None)
        # where the plan missed, by category: the largest rank's figure minus the plan, less what the plan counts
        # as gathered only while a layer computes (held bytes are read after the step, sharded again)
        held = planned - (plan.get(f"gathered_{GATHERED.get(key)}") or 0) if planned is not None else None
        missed = _gib(most - held) if None not in (most, held) else "-"
        rows.append([label, _gib(planned), *[_gib(m) for m in measured], missed])
    lines.append(table(["MEMORY GiB", "PLANNED", *[f"RANK {p['process_index']}" for p in procs], "MEASURED - PLANNED"],
                       rows))
    if peak == "peak_rss_bytes":
        lines.append("(on CPU peak RSS is mostly libraries and kernel caches; the measured parameters, gradients and "
                     "optimizer state are exact byte counts of what each rank holds)")
    lines.append("(logits: planned for a full max_seq_length of targets, measured on the first micro batch)")
    before = [p.get("cuda_peak_before_training_bytes") for p in procs]
    if any(b is not None for b in before):  # the window of the peak above starts at the first training head
        lines.append("(the CUDA peak above is read from the first training forward's output head on; before it, "
                     "loading and setup peaked at " + ", ".join(_gib(b) for b in before) + " GiB per rank)")
    paged = max(p["held"].get("paged") or 0 for p in procs)
    if paged:  # bitsandbytes' paged state: CUDA managed memory, which max_memory_allocated does not count
        lines.append(f"(optimizer state: {_gib(paged)} GiB of it paged by bitsandbytes, in CUDA managed memory, which "
                     "the allocator's peak above leaves out: it sits on the GPU until memory runs short)")
    gathered = [(name, plan.get(f"gathered_{key}") or 0) for name, key in (("parameters", "params"),
                                                                            ("gradients", "grads"))]
    if any(size for _, size in gathered):
        what = "ZeRO-3's largest layer" if setup.distributed_type == "DEEPSPEED" else \
            "FSDP's running and prefetched unit"
        lines.append("(" + " and ".join(f"{name} {_gib(size)}" for name, size in gathered if size) + " GiB of the plan "
                     f"are gathered only while a layer computes ({what}); held bytes are read after the step, when "
                     "they are sharded again: MEASURED - PLANNED leaves them out)")
    offloaded = setup.offloaded_bytes_per_micro_batch
    if offloaded is not None:
        planned = (plan.get("host_offload") or 0) / 2**20
        lines.append(f"activation offload: {offloaded / 2**20:,.2f} MiB of checkpointed inputs per micro batch waited "
                     f"in host memory (planned at full sequence length: {planned:,.2f} MiB per machine)")
    if setup.allocator_expandable_segments is not None:  # what the allocator applied, read off its segments
        lines.append("CUDA allocator: expandable segments " + ("applied" if setup.allocator_expandable_segments else
                     "NOT applied") + f" (environment: {setup.allocator_conf or 'none set'})")
    if setup.attention:
        lines.append(f"attention: {setup.attention}" + (f" ({setup.attention_why})" if setup.attention_why
                                                          else ""))
    if setup.bf16_update_rounding:
        lines.append(f"bf16 weights: {setup.optimizer_class or 'the optimizer'} rounded each update "
                     f"{setup.bf16_update_rounding}")
    if setup.optimizer_compile_seconds:
        lines.append(f"optimizer: its step compiled before step 1, in {setup.optimizer_compile_seconds:.1f} s (not in "
                     "the steps' times)")
    if setup.zero_offload_optimizer and setup.cpu_threads:
        lines.append(f"DeepSpeed's CPU Adam: {setup.cpu_threads} CPU thread(s) per process (OMP_NUM_THREADS)")
    lines += speed_lines(report["throughput"])
    first, last = report["history"][0], report["history"][-1]
    if "rewards/accuracies" in last:  # preference tuning: TRL's metrics, first and last step (and the final eval)
        final = report.get("final_eval_metrics") or {}
        lines.append("preferences: " + ", ".join(f"{k} {first[k]:.3f} -> {last[k]:.3f}" for k in
                                                 ("rewards/accuracies", "rewards/margins", "logps/chosen"))
                     + (f"; eval rewards/accuracies {final['eval_rewards/accuracies']:.3f}, margins "
                        f"{final['eval_rewards/margins']:.3f}" if "eval_rewards/accuracies" in final else ""))
    loss = f"loss: {report['history'][0]['loss']:.3f} -> {report['final_train_loss']:.3f}"
    if report.get("final_eval_loss") is not None:
        loss += f", eval {report['final_eval_loss']:.3f}"
    lines.append(loss)
    lines.append(f"advice: {report.get('advice', '')}")
    return "\n".join(lines)


def advice(report: dict, gpu_memory: int | None, bigger_micro_batch: int | None) -> str:
    """One line drawn from the figures: raise the micro batch, or the next technique in the flow."""
    recipe, procs = report["recipe"], report["processes"]
    if gpu_memory is None:  # the run folder's resolved recipe: a command that works for a user's recipe file too
        # (but a shipped recipe's own numbers for a real model, where the run trained the embedded one at its own)
        from .planning.registry import is_embedded, recipe_names

        shipped = is_embedded(recipe.get("model_name_or_path")) and recipe.get("name") in recipe_names()
        resolved = recipe["name"] if shipped else Path(report["output_dir"]) / RECIPE
        return (f"CPU smoke test passed; before renting GPUs, check the real run with "
                f"`memrecipe plan --recipe {resolved} --model MODEL --gpu-memory 80GB`")
    peak = max(p.get("cuda_max_reserved_bytes", 0) for p in procs)
    used = peak / gpu_memory
    if used < 0.75 and bigger_micro_batch and bigger_micro_batch > recipe["per_device_train_batch_size"]:
        return (f"{1 - used:.0%} of the GPU left: raise per_device_train_batch_size to {bigger_micro_batch} "
                f"(and lower gradient_accumulation_steps to keep the global batch)")
    if used > 0.9:
        if not recipe["gradient_checkpointing"] and not (recipe.get("fsdp") or {}).get("activation_checkpointing"):
            return f"{used:.0%} of the GPU used: turn on gradient_checkpointing=true before anything else"
        if recipe["distributed_type"] in ("no", "ddp"):
            return f"{used:.0%} of the GPU used: shard the model states next (fsdp, or zero3-offload on 1 GPU)"
        if (recipe.get("deepspeed") or {}).get("offload_optimizer", "none") == "none":
            return f"{used:.0%} of the GPU used: offload to CPU next (zero3-offload)"
        return f"{used:.0%} of the GPU used: lower max_seq_length or per_device_train_batch_size"
    return f"{used:.0%} of the GPU used at peak: the recipe fits with room to spare"


def _gib(n) -> str:
    """GiB to three significant digits: 0.00163, 0.52, 29.9, 132."""
    return "-" if n is None else f"{n / GiB:.3g}"


def build(out, recipe, accelerator, model_path, measured) -> dict:
    """report.json's content, from what the loop measured (training.meter.Measured) and what the planner
    predicts."""
    import importlib.metadata as md

    import torch

    from .planning.architecture import read_config, structure
    from .planning.forecast import gpu_rates
    from .planning.gpus import gpu_for_device
    from .planning.planner import estimate, largest_micro_batch
    from .planning.topology import launched_topology

    setup, history, wall = measured.setup, measured.history, measured.wall_seconds
    shape = structure(read_config(model_path))
    cuda = accelerator.device.type == "cuda"
    gpu_memory = torch.cuda.get_device_properties(accelerator.device).total_memory if cuda else None
    name = torch.cuda.get_device_name(accelerator.device) if cuda else "cpu"
    topo = launched_topology(accelerator.num_processes, cpu=not cuda)
    machines = topo.num_machines
    known = gpu_for_device(name) if cuda else None  # the forecast at this GPU's rates (the CPU's: this project's)
    plan = estimate(recipe, shape, topo, attention=setup.attention,  # the kernel that ran, not a guess
                    rates=gpu_rates(known) if known else None)
    this_session = [r for r in history if r["step"] > setup.resumed_at_step]  # what `wall` timed
    tokens = sum(r["tokens"] for r in this_session)
    slots = sum(r.get("slots", r["tokens"]) for r in this_session)  # rows x their padded width
    steps = len(history)
    # the first step is warm-up (imports finishing, kernel caches, a compile): the speed is read after it
    timed = this_session[1:] or this_session
    timed_seconds = max(sum(r["seconds"] for r in timed), 1e-9)
    speed = sum(r["tokens"] for r in timed) / timed_seconds
    # the forecast counts every position of a row (padding too), as the device computes them
    slot_speed = sum(r.get("slots", r["tokens"]) for r in timed) / timed_seconds
    per_process = speed / accelerator.num_processes
    fpt = flops_per_token(shape.active_params, setup.trainable_params, shape.layers, shape.hidden,
                          recipe.max_seq_length)
    peak = bf16_peak(name) if cuda else None
    throughput = {"tokens_per_second": speed, "tokens_per_second_per_process": per_process,
                  "seconds_per_step": sum(r["seconds"] for r in timed) / max(len(timed), 1),
                  "warmup_seconds": this_session[0]["seconds"] if len(this_session) > 1 else None,
                  "tokens_per_second_overall": tokens / wall,  # the whole run: warm-up, evals and saves included
                  "flops_per_token": fpt,
                  "padding_fraction": 1 - tokens / slots if slots else 0.0,
                  "mfu": fpt * per_process / peak if peak else None,
                  "mfu_note": "no GPU" if not cuda else (None if peak else f"{name} is not in the peak table"),
                  "forecast_tokens_per_second": plan.tokens_per_second, "forecast_on": plan.forecast_on,
                  "measured_vs_forecast": slot_speed / plan.tokens_per_second if plan.tokens_per_second else None}
    versions = {}
    for package in ("torch", "accelerate", "transformers", "peft", "deepspeed", "bitsandbytes", "datasets"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            versions[package] = None
    resolved = {"distributed_type": accelerator.distributed_type.value, "mixed_precision": accelerator.mixed_precision,
                "gradient_accumulation_steps": accelerator.gradient_accumulation_steps}
    if accelerator.state.deepspeed_plugin is not None:
        resolved["deepspeed"] = accelerator.state.deepspeed_plugin.deepspeed_config
    if getattr(accelerator.state, "fsdp_plugin", None) is not None:
        plugin = accelerator.state.fsdp_plugin
        resolved["fsdp"] = {"version": plugin.fsdp_version, "reshard_after_forward": str(plugin.reshard_after_forward),
                            "state_dict_type": str(plugin.state_dict_type),
                            "activation_checkpointing": plugin.activation_checkpointing}
    report = {"recipe": recipe.to_dict(), "model": model_path, "output_dir": str(Path(out).resolve()), "versions": versions,
              "resolved_config": resolved, "setup": setup.to_dict(), "device": name,
              "topology": {"processes": accelerator.num_processes, "machines": machines, "describe": topo.describe(),
                           "gpu_memory": gpu_memory},
              "plan": plan.as_dict(), "processes": measured.processes, "throughput": throughput, "steps": steps,
              "wall_seconds": wall, "final_train_loss": history[-1]["loss"], "final_eval_loss": measured.eval_loss,
              "final_eval_metrics": measured.eval_metrics, "history": history}
    bigger = largest_micro_batch(recipe, shape, topo, gpu_memory, None, 4 * recipe.per_device_train_batch_size) \
        if cuda else None
    report["advice"] = advice(report, gpu_memory, bigger)
    return report


def write_report(run, recipe, accelerator, model_path, measured) -> str:
    """report.json and loss.png in the run folder (main process); returns the card and where they are."""

    report = build(run.path, recipe, accelerator, model_path, measured)
    run.report.write_text(json.dumps(report, indent=2))
    plotted = plot_loss(report, run.loss_plot)
    return card(report) + f"\nrun folder {run.path.resolve()}: final/, report.json" + (
        ", loss.png" if plotted else " (no loss.png: matplotlib is missing, pip install matplotlib)")


def compare_rows(reports: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Runs side by side: recipe, processes, peak memory, tokens/s, MFU, final loss."""
    headers = ["RUN", "RECIPE", "PROCESSES", "PEAK GiB", "TOKENS/S", "MFU", "TRAIN LOSS", "EVAL LOSS"]
    rows = []
    for r in reports:
        procs = r["processes"]
        key = peak_key(procs[0])
        mfu = r["throughput"].get("mfu")
        rows.append([Path(r["output_dir"]).name, r["recipe"]["name"], str(r["topology"]["processes"]),
                     _gib(max(p[key] for p in procs)) + (" (RSS)" if key == "peak_rss_bytes" else ""),
                     f"{r['throughput']['tokens_per_second']:,.0f}", "-" if mfu is None else f"{mfu:.1%}",
                     f"{r['final_train_loss']:.3f}",
                     "-" if r.get("final_eval_loss") is None else f"{r['final_eval_loss']:.3f}"])
    return headers, rows
