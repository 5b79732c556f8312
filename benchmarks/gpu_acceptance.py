"""The first command on a GPU box: every recipe the machine can hold, a few steps each through `memrecipe run`,
on real-shaped models with random weights built from the config.json files beside this script (no hub), then
one run stopped and resumed, preference tuning (`memrecipe run dpo`) on the embedded pairs, and one long-context
run (16K tokens a sequence on the activation ladder's top rung, generated documents); one table of what the plan said
against what the runs measured.

    python benchmarks/gpu_acceptance.py                        # the 1B shape, every recipe this box can hold
    python benchmarks/gpu_acceptance.py --shapes 1b,moe,8b     # the larger shapes too (opt-in)
    python benchmarks/gpu_acceptance.py --cpu                  # tiny smoke mode (the test suite runs it)
    python benchmarks/gpu_acceptance.py --recipes single-gpu-lora,adamw-8bit --steps 6   # a short lease: these first

The table is rewritten after every row, so a lease that ends mid-run keeps what ran.

Writes OUT/acceptance.md and OUT/acceptance.json (default OUT: acceptance-<time>/): per run the planned and
measured bytes per category and in total, the measured minus planned total, tokens/s, MFU, whether the loss
fell, the plan's step-time forecast (docs/speed.md); whether the stopped-and-resumed run's steps equal the
uninterrupted run's; and peers on the same shape beside single-gpu-lora, adamw-8bit and the long-context row
(transformers' Trainer, TRL's SFTTrainer: benchmarks/peers.py), their tokens/s and allocator peak against ours.
A recipe the box cannot hold
(GPUs, GPU memory or host RAM by the plan) or whose optional library is missing is skipped, with the reason.
The data is the embedded chat set and preference pairs (on a GPU repeated until every step has full micro batches: once
through, the chat set packs into 5 rows of 2048 tokens, the pairs into 9); the tokenizer is the embedded one (its ids fit any vocabulary).
"""

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = {"1b": "llama-3.2-1b.json", "moe": "olmoe-1b-7b.json", "8b": "llama-3.1-8b.json"}
# (recipe, overrides, processes); the first is also stopped and resumed
# a row with attn_implementation=sdpa is checked against its recipe's row under auto (flash-attn or flex_attention)
# single-gpu-lora with its dropout redrawn (lora.redraw_dropout: auto takes peft's at the 1B's 2K tokens): the
# redraw's price in a launch-bound step; compiled: what fewer launches buy there (docs/speed.md)
ONE_GPU = [("single-gpu-lora", [], 1), ("single-gpu-lora", ["attn_implementation=sdpa"], 1),
           ("single-gpu-lora", ["lora.redraw_dropout=true"], 1), ("single-gpu-lora", ["torch_compile=true"], 1), ("qlora", [], 1),
           ("qlora", ["activation_offload=true"], 1), ("single-gpu-full", [], 1),
           ("single-gpu-full", ["optim=apollo_adamw", "optim_args.rank=128"], 1), ("adamw-8bit", [], 1),
           ("zero3-offload", [], 1), ("zero3-offload", ["lora.r=16", "lora.target_modules=all-linear"], 1),
           ("ddp", [], 1)]  # (ZeRO-3's LoRA: the adapters in the engine's bf16, peft's dropout, its reduce bucket)
SEVERAL_GPUS = [("ddp", [], 0), ("fsdp", [], 0), ("fsdp-lora", [], 0), ("fsdp-qlora", [], 0), ("zero2", [], 0),
                ("tp", [], 4), ("zero3-ulysses", [], 2),  # 0: every GPU; zero3-ulysses: each sequence split 2 ways
                ("fsdp-lora", ["parallelism.cp_size=2", "packing=false"], 2)]  # ... and by ring attention
# --cpu (the suite's smoke of this script): one process a row (the suite runs every engine elsewhere)
CPU = [("single-gpu-lora", [], 1), ("single-gpu-lora", ["attn_implementation=sdpa"], 1)]
# long context: one document of max_seq_length tokens a micro batch, on the ladder's top rung (docs/long-context.md),
# the adapters' dropout redrawn as the 32-layer plans need it at their longest (`auto` would decide on the cut model)
LONG = ("single-gpu-lora", ["activation_offload=true", "lean_norms=true", "tiled_mlp=true",
                            "per_device_train_batch_size=1", "gradient_accumulation_steps=1", "packing=false",
                            "lora.redraw_dropout=true"], 1)
LONG_TOKENS = {"gpu": 16384, "cpu": 1024}
# long-8b: Llama-3.1-8B's widths cut to LONG_8B_LAYERS layers (random weights), one document a step on the top rung,
# under each kernel named: with the layers' inputs offloaded, the GPU's per-token working bytes are the 32-layer
# model's, so the allocator's peak at the 32-layer plan's longest length checks the plan where it binds; the pinned
# host bytes (the offload's registered arena, torch's host allocator) against the plan's pinned host figure. Each row two steps, with
# the allocator's history recorded (snapshot_peak.py reads its peak blocks). --cpu: the embedded model at 1K, sdpa's
# kernel in query chunks of 256 (on a GPU `true`'s 16,384: the plan's rung past 512K).
LONG_8B_LAYERS = 2
LONG_8B_KERNELS = {"gpu": ("sdpa+chunks", "flex_attention"), "cpu": ("sdpa+chunks",)}


def kernel_words(kernel: str, cpu: bool) -> list[str]:
    """A long-8b row's words for its kernel: `sdpa+chunks` is sdpa in query chunks (the query chunks rung)."""
    if kernel == "sdpa+chunks":
        return ["attn_implementation=sdpa", f"query_chunks={256 if cpu else 'true'}"]
    return [f"attn_implementation={kernel}"]
# peers on the same shape, data sizes and settings (benchmarks/peers.py), run after the recipe's own row: (label,
# library, method); the long-context row's peer is Trainer's LoRA at its length, one row a step
PEERS = {"single-gpu-lora": [("Trainer + peft LoRA", "trainer", "lora"), ("TRL SFTTrainer, LoRA", "trl", "lora")],
         "adamw-8bit": [("Trainer, 8-bit AdamW", "trainer", "full-8bit")],
         "long": [("Trainer + peft LoRA", "trainer", "lora")]}
PREFERENCES = [("single-gpu-lora", [], 1), ("qlora", [], 1)]
PROFILED = ("single-gpu-lora", "adamw-8bit")  # one step's profile, beside their plain rows (docs/gpu.md: where time goes)  # `memrecipe run dpo` on the embedded pairs (--cpu: the first)
LIBRARIES = {"qlora": "bitsandbytes", "fsdp-qlora": "bitsandbytes", "adamw-8bit": "bitsandbytes",
             "single-gpu-full": "torchao", "apollo_adamw": "apollo_torch", "zero3-offload": "deepspeed",
             "zero2": "deepspeed", "zero3-ulysses": "deepspeed"}
# seconds a row is given beyond --timeout to compile before step 1: torchao's 8-bit AdamW, a graph per kind of
# parameter (torchao measured ~12 minutes on a 7B; a 1B's kinds are fewer and smaller)
COMPILES = {"adamw_torch_8bit": 900}
CATEGORIES = ("parameters", "gradients", "optimizer_state", "logits")
GiB = 2**30
# The memory verdict. Over: a measured category more than 5% above its plan fails (the model states are counted
# tensor by tensor, so 5% is room for allocator rounding and small unplanned buffers, not for a missing term: a run
# planned to fit that does not is the failure this guards). Under: more than 20% below fails too (a plan 25% high
# refuses runs that would fit, and hides which term is wrong). Categories under 1 MiB both ways are not judged.
OVER, UNDER, JUDGED_FROM = 1.05, 0.80, 2**20
# A device reading is device-wide: a GPU that held more than BUSY before a row started (another process; an idle
# H100 reads 0 MiB in nvidia-smi) is not judged on it
BUSY = 256 * 2**20


def build_model(config_file: Path, folder: Path) -> Path:
    """A random-weight model of the config's shape, with the embedded tokenizer, saved like a hub model: built in a
    child process, so that the GPU memory the build takes (its weights in the caching allocator, a CUDA context) is
    given back before the rows run. The rows' device readings are device-wide (mem_get_info): on the second lease
    each read ~3.5 GiB high while this process held the 1B's build."""
    if not (folder / "config.json").is_file():
        subprocess.run([sys.executable, "-c", "import runpy, sys; runpy.run_path(sys.argv[1])['build_here'](*sys.argv[2:])",
                        __file__, str(config_file), str(folder)], check=True)
    return folder


def build_here(config_file: str, folder: str):
    """build_model's child: the model on the GPU where there is one (random init is slow on a CPU), then saved."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from memrecipe.planning.registry import EMBEDDED_MODEL

    config = AutoConfig.for_model(**json.loads(Path(config_file).read_text()))
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(EMBEDDED_MODEL).save_pretrained(folder)


def cut_config(config_file: Path, layers: int, out: Path) -> Path:
    """The config with its first `layers` decoder layers only (long-8b's model)."""
    config = json.loads(config_file.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**config, "num_hidden_layers": layers}))
    return out


def long_8b_lengths(config_file: Path, kernel: str) -> int:
    """The longest sequence the 32-layer model's plan fits on one 80 GB GPU (80e9 bytes) on the top rung under
    `kernel`: the length a long-8b row runs at unless --long-8b-tokens names one."""
    from memrecipe.planning.architecture import read_config, structure
    from memrecipe.planning.ladder import longest
    from memrecipe.planning.registry import load_recipe
    from memrecipe.planning.topology import Topology

    recipe = load_recipe(LONG[0], [*LONG[1], *kernel_words(kernel, cpu=False)])
    return longest(recipe, structure(read_config(str(config_file))), Topology(1), 80e9, 2**50)[0]


def long_documents(path: Path, documents: int, tokens: int) -> Path:
    """A dataset of `documents` texts, each longer than `tokens` tokens of the embedded tokenizer (a run cuts them
    at max_seq_length): the long-context row's data, written here (no hub)."""
    import random

    rng = random.Random(0)
    words = "the of and model data memory token layer river stone cloud light table music ocean number".split()
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(tokens))}) + "\n"
                            for _ in range(documents)))
    return path


def repeated(source: Path, path: Path, steps: int, tokens_once: int) -> Path:
    """An embedded set (`tokens_once`: its training tokens, the runs' `data:` line), repeated until `steps` steps of
    the largest micro batch x accumulation any row uses (16 rows of 2048 tokens; packing fills ~80%) have data."""
    copies = -(-steps * 16 * 2048 * 5 // (4 * tokens_once)) + 1
    path.write_text(source.read_text() * copies)
    return path


def skip_reason(recipe: str, overrides: list, processes: int, model: str | None, cpu: bool) -> str | None:
    """Why this box cannot run the case (None: it can), from the optional libraries and the plan."""
    from memrecipe.errors import RecipeError
    from memrecipe.planning.architecture import read_config, structure
    from memrecipe.planning.planner import estimate
    from memrecipe.planning.registry import load_recipe
    from memrecipe.planning.topology import Topology

    for key in (recipe, *(w.split("=", 1)[1] for w in overrides if w.startswith("optim="))):
        if key in LIBRARIES and importlib.util.find_spec(LIBRARIES[key]) is None:
            return f"{LIBRARIES[key]} is not installed"
    try:
        r = load_recipe(recipe, overrides)
        if processes < r.supports.min_processes:
            return f"needs {r.supports.min_processes}+ processes, the box has {processes}"
        if cpu:
            return None if r.supports.cpu else "GPU-only"
        plan = estimate(r, structure(read_config(model)), Topology(processes))
    except RecipeError as e:
        return str(e)
    import torch

    gpu = torch.cuda.get_device_properties(0).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if plan.total > gpu:
        return f"plans {plan.total / GiB:.1f} GiB per GPU, the GPU has {gpu / GiB:.1f}"
    if plan.host_total() > host:
        return f"plans {plan.host_total() / GiB:.0f} GiB of host RAM, the box has {host / GiB:.0f}"
    return None


def row_timeout(recipe: str, overrides: list, timeout: float, cpu: bool) -> float:
    """--timeout, and on a GPU the time the row's optimizer compiles before step 1 (COMPILES)."""
    if cpu:
        return timeout  # (torchao's step runs eagerly off CUDA)
    from memrecipe.planning.registry import load_recipe

    return timeout + COMPILES.get(load_recipe(recipe, overrides).optim, 0)


def run(folder: Path, recipe: str, words: list, processes: int, cpu: bool, timeout: float, script: str = "sft",
        snapshot: bool = False, profile: bool = False) -> tuple[dict | None, str]:
    """One `memrecipe run SCRIPT`; (its report.json, '') or (None, why it failed). `snapshot`: record the CUDA
    allocator's history, `profile`: where the second step's time goes (each a run of its own: recording slows the
    steps it covers, which would bias tokens/s)."""
    cmd = [sys.executable, "-m", "memrecipe", "run", script, "--recipe", recipe, "--output-dir", str(folder),
           "--num-processes", str(processes), *(["--cpu"] if cpu else []), *(["--memory-snapshot"] * snapshot),
           *(["--profile"] * profile), *words]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"over {timeout:.0f} s"
    (folder.parent / f"{folder.name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return None, why_failed(done)
    return json.loads((folder / "report.json").read_text()), ""


def why_failed(done: subprocess.CompletedProcess) -> str:
    """The line that says why a run failed: memrecipe's one-line error, else the worker's exception (the last
    lines are the launcher's own traceback and the run's banner)."""
    lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
    said = [line for line in lines if line.startswith("memrecipe: error") or re.match(r"\w+(Error|Exception)\b", line)
            and not line.startswith("subprocess.CalledProcessError")]
    return (said or lines)[-1][:300]


def device_in_use() -> int | None:
    """Bytes the GPUs already hold (the most on one) before a row starts, by nvidia-smi; None where it cannot say."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60).stdout
        return max(int(v) for v in out.split()) * 2**20
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def row(name: str, shape: str, processes: int, report: dict, busy: int | None = None) -> dict:
    """The table's row for one run; `busy`: bytes the device held before it started (another process's), which the
    device-wide reading would count as the run's: past BUSY, that reading is reported and not judged."""
    plan, procs = report["plan"], report["processes"]
    peak_key = next((k for k in ("cuda_max_allocated_bytes", "peak_rss_bytes") if k in procs[0]), None)
    measured = {c: max(p["held"].get(c) or 0 for p in procs) for c in CATEGORIES}
    # the allocator's peak, with bitsandbytes' paged optimizer state it never sees (CUDA managed memory)
    peak = max((p.get(peak_key) or 0) + (p["held"].get("paged") or 0 if peak_key == "cuda_max_allocated_bytes" else 0)
               for p in procs) if peak_key else None
    history, tput = report["history"], report["throughput"]
    planned = {c: plan.get(c) for c in (*CATEGORIES, "total")}
    used = max((p.get("cuda_device_used_peak_bytes") or 0 for p in procs), default=0) or None
    shared = bool(used and busy and busy > BUSY)
    verdict, why = memory_verdict(planned, {**measured, "total": peak, "device_used": None if shared else used},
                                  plan.get("overhead") or 0, peak_key)
    if shared:
        why += f"; device used not judged: {busy / GiB:.2g} GiB was in use on the device before the run (not its own)"
    # pinned, on the machine: the activation offload's block (registered host memory, layers.HostArena) and what
    # torch's pinned allocator holds beside it (DeepSpeed's offload buffers, the loader's batches), every process's,
    # against the plan's pinned part of its host figure (Estimate.host_pinned: not CPU Adam's pageable state)
    host = {"host_planned": plan.get("host_pinned"),
            "host_pinned_peak": sum((p.get("offload_host_bytes") or 0) + (p.get("cuda_host_allocated_bytes_peak") or 0)
                                    for p in procs) or None}
    return {"recipe": name, "shape": shape, "processes": processes, "status": "ran", **host,
            "memory_verdict": verdict, "memory_why": why,
            "attention": report["setup"].get("attention"),
            "query_chunk": report["setup"].get("query_chunk") or None,  # queries a call of sdpa's kernel (query chunks)
            "planned": planned,
            "measured": {**measured, "total": peak, "device_used": used}, "peak_kind": peak_key,
            "device_in_use_before": busy,
            "measured_minus_planned_total": None if peak is None else peak - plan["total"],
            "tokens_per_second": tput["tokens_per_second"], "mfu": tput.get("mfu"),
            # the plan's step-time forecast on this GPU (docs/speed.md), and the run against it (padding counted)
            "forecast_tokens_per_second": tput.get("forecast_tokens_per_second"),
            "measured_vs_forecast": tput.get("measured_vs_forecast"),
            "compile_seconds": report["setup"].get("optimizer_compile_seconds") or None,  # before step 1
            "loss_first": history[0]["loss"], "loss_last": report["final_train_loss"],
            "loss_fell": report["final_train_loss"] < history[0]["loss"],
            # preference tuning: the last step's reward accuracy on its training pairs
            "reward_accuracy": history[-1].get("rewards/accuracies")}


def profile_of(out: Path, tag: str, recipe: str, words: list, processes: int, cpu: bool, timeout: float) -> str:
    """A 3-step run of the row with --profile; its step-2 table copied to OUT/profile-RECIPE.txt (that path), or why
    there is none."""
    folder = out / f"{tag}-profile"
    _, why = run(folder, recipe, [*words, "save_steps=null", "max_steps=3"], processes, cpu, timeout,
                 profile=True)  # (the later words win)
    table = folder / "profile_rank0.txt"
    if not table.is_file():
        return f"none: {why or 'the run wrote no profile'}"
    shutil.copy(table, out / f"profile-{recipe}.txt")
    return str(out / f"profile-{recipe}.txt")


def peers_of(script: str, recipe: str, overrides: list) -> list[tuple]:
    """The peers a row is run beside: a recipe's plain SFT row, and the long-context row."""
    if script != "sft":
        return []
    return PEERS["long"] if is_long(overrides) else [] if overrides else PEERS.get(recipe, [])


def peer_rows(ours: dict, report: dict, peers: list, model: str, out: Path, cpu: bool, steps: int,
              timeout: float) -> list[dict]:
    """Each peer on our row's model and shape (length, micro batch, accumulation, kernel, steps), and our row's speed
    and allocator peak against its: a ratio above 1 is memrecipe faster, or holding less."""
    r, rows = report["recipe"], []
    for label, library, method in peers:
        file = out / f"peer-{ours['shape']}-{library}-{method}-{r['max_seq_length']}.json"
        cmd = [sys.executable, str(HERE / "peers.py"), "--library", library, "--method", method, "--model", model,
               "--seq", str(r["max_seq_length"]), "--micro", str(r["per_device_train_batch_size"]),
               "--accumulation", str(r["gradient_accumulation_steps"]), "--steps", str(steps),
               "--attention", ours["attention"] or "sdpa", "--out", str(file), *(["--cpu"] if cpu else [])]
        base = {"recipe": f"peer: {label}", "peer_of": ours["recipe"], "shape": ours["shape"], "processes": 1}
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            rows.append(base | {"status": "failed", "reason": f"over {timeout:.0f} s"})
            continue
        (out / f"{file.stem}.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            rows.append(base | {"status": "failed", "reason": why_failed(done)})
            continue
        peer = json.loads(file.read_text())
        ours_peak = ours["measured"]["total"] if ours.get("peak_kind") == "cuda_max_allocated_bytes" else None
        rows.append(base | {"status": "peer", "attention": ours["attention"],
                            "tokens_per_second": peer["tokens_per_second"], "peak": peer["peak_bytes"],
                            "speed_ratio": ours["tokens_per_second"] / peer["tokens_per_second"]
                            if peer["tokens_per_second"] else None,
                            "memory_ratio": peer["peak_bytes"] / ours_peak if ours_peak and peer["peak_bytes"] else None})
    return rows


def memory_verdict(planned: dict, measured: dict, allowance: int, peak_kind: str | None) -> tuple[str, str]:
    """("PASS" | "FAIL", why): each model-state category's measured bytes (the largest process's held storages)
    against its plan, and on a GPU the allocator's peak against the plan's total less its allowance for the CUDA
    context and the allocator's slack (which the allocator does not see), within UNDER..OVER. The logits are not
    judged here (the loss's window is measured apart)."""
    pairs = [(c, planned.get(c) or 0, measured.get(c) or 0) for c in ("parameters", "gradients", "optimizer_state")]
    if peak_kind == "cuda_max_allocated_bytes":
        pairs.append(("total (allocator peak vs plan less allowance)", planned["total"] - allowance, measured["total"]))
    if measured.get("device_used"):  # what the driver says the device holds, against the whole plan
        pairs.append(("device used (mem_get_info, sampled) vs the whole plan", planned["total"], measured["device_used"]))
    wrong = [f"{c}: {m / GiB:.3g} GiB measured, {p / GiB:.3g} planned ({m / p:.2f}x)" if p else
             f"{c}: {m / GiB:.3g} GiB measured, none planned"
             for c, p, m in pairs if max(p, m) >= JUDGED_FROM and not (p and UNDER <= m / p <= OVER)]
    if wrong:
        return "FAIL", "; ".join(wrong) + f" (allowed {UNDER:.2f}x-{OVER:.2f}x of the plan)"
    judged = [c.split(" ")[0] for c, p, m in pairs if max(p, m) >= JUDGED_FROM]
    return "PASS", f"{', '.join(judged)} within {UNDER:.2f}x-{OVER:.2f}x of the plan"


def resume_check(whole_folder: Path, processes: int, cpu: bool, timeout: float, steps: int, whole: dict) -> dict:
    """The uninterrupted run, stopped at its half-way checkpoint (a copy of its folder as a stop leaves it: no later
    checkpoint, no final save, no report) and resumed to the end: the resumed steps' losses must equal its own."""
    half = steps // 2
    folder = whole_folder.parent / f"{whole_folder.name}-resumed"
    shutil.copytree(whole_folder, folder)
    for later in [*(folder / "checkpoints").glob("step-*"), folder / "final", folder / "report.json"]:
        if later.exists() and later.name != f"step-{half}":
            shutil.rmtree(later) if later.is_dir() else later.unlink()
    cmd = [sys.executable, "-m", "memrecipe", "run", "sft", "--resume", "--output-dir", str(folder),
           "--num-processes", str(processes), *(["--cpu"] if cpu else []), f"max_steps={steps}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"resume_exact": False, "resume_note": f"the resumed run took over {timeout:.0f} s"}
    (folder.parent / f"{folder.name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return {"resume_exact": False, "resume_note": why_failed(done)}
    resumed = json.loads((folder / "report.json").read_text())["history"]
    ours = {h["step"]: h["loss"] for h in whole["history"]}
    diffs = [abs(h["loss"] - ours[h["step"]]) for h in resumed if h["step"] > half]
    exact = bool(diffs) and max(diffs) <= 1e-3 * max(1.0, max(abs(v) for v in ours.values()))
    return {"resume_exact": exact, "resume_note": f"max |loss difference| over steps {half + 1}-{steps}: "
                                                  f"{max(diffs) if diffs else float('nan'):.2e}"}


def kernel_check(result: dict, auto: dict | None) -> dict:
    """An sdpa row against its recipe's row under auto: the same weights, data and seed, so the first step's loss
    must agree to bf16's precision whichever kernel auto took; and the tokens/s auto gains."""
    if auto is None:
        return {}
    first, theirs = result["loss_first"], auto["loss_first"]
    agree = abs(first - theirs) <= 2e-2 * max(1.0, abs(first))
    return {"kernels_agree": agree, "kernel_note": f"step 1 loss {theirs:.4f} under {auto['attention']} vs {first:.4f} "
                                                  f"under sdpa; {auto['tokens_per_second'] / result['tokens_per_second']:.2f}"
                                                  f"x the tokens/s"}


def markdown(rows: list[dict]) -> str:
    def gib(n):
        return "-" if n is None else f"{n / GiB:.3g}"

    head = ["recipe", "shape", "procs", "status", "attention",
            *[f"{c} planned/measured GiB" for c in (*CATEGORIES, "total")], "pinned host planned/measured GiB",
            "measured-planned", "memory", "tokens/s", "forecast tok/s (measured / forecast)",
            "MFU",
            "loss", "resume / kernels"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    peers = [r for r in rows if "peer_of" in r]
    for r in rows:
        if "peer_of" in r:
            continue
        if r["status"] != "ran":
            lines.append(f"| {r['recipe']} | {r['shape']} | {r['processes']} | {r['status']}: {r['reason']} |"
                         + " |" * (len(head) - 4))
            continue
        cells = [f"{gib(r['planned'][c])} / {gib(r['measured'][c])}" for c in (*CATEGORIES, "total")]
        cells.append(f"{gib(r.get('host_planned'))} / {gib(r.get('host_pinned_peak'))}")
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        loss = f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} ({'falls' if r['loss_fell'] else 'FAIL'})" + (
            f", reward accuracy {r['reward_accuracy']:.2f}" if r.get("reward_accuracy") is not None else "")
        resume = {True: "exact", False: "FAIL", None: "-"}[r.get("resume_exact")]
        if "kernels_agree" in r:
            resume = ("agree: " if r["kernels_agree"] else "FAIL: ") + r["kernel_note"]
        lines.append(f"| {r['recipe']} | {r['shape']} | {r['processes']} | ran | {r['attention']} | " + " | ".join(cells)
                     + f" | {gib(r['measured_minus_planned_total'])} | {r['memory_verdict']}: {r['memory_why']}"
                     f" | {r['tokens_per_second']:,.0f}" + (f" ({r['compile_seconds']:.0f} s compile before step 1)"
                                                            if r.get("compile_seconds") else "")
                     + f" | {forecast(r)} | {mfu} | {loss}"
                     f" | {resume} |")
    if peers:  # the same shape through transformers' Trainer and TRL (benchmarks/peers.py)
        lines += ["", "| peer | beside | attention | tokens/s | allocator peak GiB | memrecipe's speed x | "
                  "memrecipe's memory x (peer's peak / ours) |", "|---|---|---|---|---|---|---|"]
        for r in peers:
            if r["status"] != "peer":
                lines.append(f"| {r['recipe']} | {r['peer_of']} | {r['status']}: {r['reason']} | | | | |")
                continue
            speed = "-" if r["speed_ratio"] is None else f"{r['speed_ratio']:.2f}x"
            memory = "-" if r["memory_ratio"] is None else f"{r['memory_ratio']:.2f}x"
            rate = "-" if r["tokens_per_second"] is None else f"{r['tokens_per_second']:,.0f}"
            lines.append(f"| {r['recipe']} | {r['peer_of']} | {r['attention']} | {rate} | {gib(r['peak'])} | "
                         f"{speed} | {memory} |")
    return "\n".join(lines) + "\n"


def forecast(r: dict) -> str:
    """'30,469 (1.00x)': the plan's forecast for the row and the run's speed against it."""
    if not r.get("forecast_tokens_per_second"):
        return "-"
    return f"{r['forecast_tokens_per_second']:,.0f} ({r['measured_vs_forecast']:.2f}x)"


def is_long(overrides: list) -> bool:
    """The long-context row (LONG): the one on the tiled MLP, run on the long documents."""
    return "tiled_mlp=true" in overrides


def length_word(overrides: list) -> str:
    """A long row's `max_seq_length=N` word, wherever it stands: which long documents it runs on."""
    return next(word for word in overrides if word.startswith("max_seq_length="))


def case_name(script: str, recipe: str, overrides: list) -> str:
    """A row's name in the table: `dpo` for preference tuning, the recipe, its overrides."""
    return " ".join(["dpo"] * (script == "dpo") + [recipe, *overrides])


def pick(cases: list[tuple], names: list[str], exact: bool = False) -> list[tuple]:
    """The cases (script, recipe, overrides, processes) named, in the order named: a recipe names all its rows (in the
    script's order), a row's name (`dpo qlora`, `qlora activation_offload=true`) that row, `long` the long-context
    rows; `exact`: a name is a row's name only (`single-gpu-lora`: its plain row, not its sdpa, long or DPO rows);
    ValueError says what no row answers to."""
    def matches(case, name):
        named = (case_name(*case[:3]),) if exact else (case[1], case_name(*case[:3]))
        return name in named or (name == "long" and is_long(case[2]))

    if unknown := [n for n in names if not any(matches(c, n) for c in cases)]:
        raise ValueError(f"--recipes: no row answers to {', '.join(unknown)}; the rows here run "
                         + ", ".join(sorted({c[1] for c in cases})) + " (or name a row, or `long`)")
    picked = []
    for name in names:
        picked += [c for c in cases if matches(c, name) and c not in picked]
    return picked


def write(out: Path, rows: list[dict]):
    """acceptance.json and acceptance.md, rewritten after each row: a lease that ends mid-run keeps what ran."""
    (out / "acceptance.json").write_text(json.dumps(rows, indent=1))
    (out / "acceptance.md").write_text(markdown(rows))


def long_8b_cases(spec: str | None, kernels: tuple, default) -> list[tuple[str, int]]:
    """(kernel, length) pairs in the order to run: `spec` lists `KERNEL:LENGTH` (that kernel) or `LENGTH` (every
    kernel), comma-separated; without one, each kernel at default(kernel)."""
    if not spec:
        return [(k, default(k)) for k in kernels]
    pairs = []
    for item in spec.split(","):
        kernel, _, length = item.rpartition(":")
        pairs += [(k, int(length)) for k in ([kernel] if kernel else kernels)]
    return pairs


def long_8b_rows(args, steps: int, timeout: float) -> list[dict]:
    """The long-8b rows (LONG_8B_KERNELS x lengths), each written to the table as it ends."""
    side = "cpu" if args.cpu else "gpu"
    config = HERE / "gpu_configs" / SHAPES["8b"]
    model = None if args.cpu else str(build_model(cut_config(config, LONG_8B_LAYERS, args.out / "long-8b.json"),
                                                  args.out / "models" / "long-8b"))
    rows = []
    for kernel, length in long_8b_cases(args.long_8b_tokens, LONG_8B_KERNELS[side],
                                        lambda k: LONG_TOKENS["cpu"] if args.cpu else long_8b_lengths(config, k)):
        name = f"long-8b {kernel} {length / 1024:g}K"
        data = long_documents(args.out / f"long-{length}.jsonl", steps + 2, length)
        words = [*LONG[1], *kernel_words(kernel, args.cpu), f"max_seq_length={length}", f"max_steps={steps}",
                 "save_steps=null", "eval_steps=null", "--dataset", str(data),
                 *([] if model is None else ["--model", model])]
        shape = "embedded" if args.cpu else f"8b, {LONG_8B_LAYERS} layers"
        report, why = run(args.out / f"long-8b-{kernel}-{length}", LONG[0], words, 1, args.cpu, timeout,
                          snapshot=not args.cpu)
        rows.append(row(name, shape, 1, report) if report else
                    {"recipe": name, "shape": shape, "processes": 1, "status": "failed", "reason": why})
        print(f"{name}: {rows[-1]['status']} {rows[-1].get('reason') or rows[-1]['memory_why']}", flush=True)
        write(args.out, rows)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="smoke mode: the embedded tiny model, one process a row")
    parser.add_argument("--shapes", default="1b", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--steps", type=int, default=None, help="steps per run, even (default 10; --cpu 4)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run (default 900; --cpu 400: a bound "
                        "for a hang, not for a busy machine, where a ~15 s run once took over 120 s)")
    parser.add_argument("--recipes", default=None, help="comma-separated: recipe names (all their rows: SFT, "
                        "DPO, the long-context row), row names as the table prints them (`dpo qlora`, "
                        "`qlora activation_offload=true`) or `long`; run in this order (default: every row)")
    parser.add_argument("--long-8b-tokens", default=None, help="the long-8b rows in order, comma-separated: "
                        "KERNEL:LENGTH or LENGTH (every kernel) (default: each kernel at the 32-layer plan's longest on "
                        "one 80 GB GPU); `--recipes long-8b` runs them alone")
    parser.add_argument("--long-8b-steps", type=int, default=2, help="steps a long-8b row runs on a GPU (default 2; "
                        "1 where a lease is short: the peak is the first backward's, LoRA's optimizer state is small)")
    parser.add_argument("--exact", action="store_true", help="--recipes names rows only (`single-gpu-lora`: its "
                        "plain row), not every row of a recipe")
    parser.add_argument("--no-resume", dest="resume", action="store_false", help="the first row is not stopped and "
                        "resumed, nor its allocator history recorded (two launches fewer: a short lease's speed rows)")
    parser.add_argument("--long-tokens", default=str(LONG_TOKENS["gpu"]), help="the long-context rows' lengths on a "
                        f"GPU, comma-separated (default {LONG_TOKENS['gpu']}; its Trainer peer at each)")
    parser.add_argument("--out", type=Path, default=Path(time.strftime("acceptance-%Y%m%d-%H%M%S")))
    args = parser.parse_args()
    steps, timeout = args.steps or (4 if args.cpu else 10), args.timeout or (400 if args.cpu else 900)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        shapes, gpus, cases = {"embedded": None}, 2, [("sft", *c) for c in CPU] + [("dpo", *PREFERENCES[0])]
    else:
        import torch

        if not torch.cuda.is_available():
            sys.exit("gpu_acceptance: no CUDA device here (--cpu runs the smoke mode)")
        gpus = torch.cuda.device_count()
        shapes = {s: None for s in args.shapes.split(",")}
        cases = [("sft", *c) for c in ONE_GPU + ([(r, o, n or gpus) for r, o, n in SEVERAL_GPUS] if gpus > 1 else [])]
        cases += [("dpo", *c) for c in PREFERENCES]
    lengths = [LONG_TOKENS["cpu"]] if args.cpu else [int(n) for n in args.long_tokens.split(",")]
    long_data = {f"max_seq_length={n}": long_documents(args.out / f"long-{n}.jsonl", steps + 2, n) for n in lengths}
    if not args.cpu:
        from memrecipe.planning.registry import EMBEDDED_DATASET, EMBEDDED_PREFERENCES

        data = {"sft": repeated(EMBEDDED_DATASET, args.out / "chat.jsonl", steps, 8211),
                "dpo": repeated(EMBEDDED_PREFERENCES, args.out / "pairs.jsonl", steps, 16393)}
    if not args.cpu:  # (--cpu: long-8b's smoke row is this row, on the embedded model)
        cases += [("sft", LONG[0], [*LONG[1], f"max_seq_length={n}"], LONG[2]) for n in lengths]
    names = args.recipes.split(",") if args.recipes else []
    if args.recipes:  # a short lease: the named recipes' rows, in the order named (index 0 is still the resumed one)
        try:
            cases = pick(cases, [n for n in names if n != "long-8b"], exact=args.exact)
        except ValueError as e:
            parser.error(str(e))
    rows = []
    if not names or "long-8b" in names:  # the long-context rows first: a lease's time goes to them before the rest
        rows += long_8b_rows(args, steps=steps if args.cpu else args.long_8b_steps, timeout=timeout)
    for shape in shapes:
        model = None if args.cpu else str(build_model(HERE / "gpu_configs" / SHAPES[shape], args.out / "models" / shape))
        extra = ["lora.dropout=0"] if shape == "moe" else []  # peft's fused-expert adapters take no dropout
        for index, (script, recipe, overrides, processes) in enumerate(cases):
            name = case_name(script, recipe, overrides)
            words = [*overrides, *extra, f"max_steps={steps}", "save_steps=null", "eval_steps=null",
                     *([] if model is None else ["--model", model]),
                     *(["--dataset", str(long_data[length_word(overrides)])] if is_long(overrides) else
                       [] if args.cpu else ["--dataset", str(data[script])])]
            reason = skip_reason(recipe, [*overrides, *extra], processes, model, args.cpu)
            if reason:
                rows.append({"recipe": name, "shape": shape, "processes": processes, "status": "skipped",
                             "reason": reason})
                print(f"{name} ({shape}): skipped: {reason}", flush=True)
                continue
            tag = f"{shape}-{index}-{script}-{recipe}"
            resumed = index == 0 and args.resume
            if resumed:  # a checkpoint half-way, to stop at and resume from
                words.append(f"save_steps={steps // 2}")
            busy = None if args.cpu else device_in_use()
            report, why = run(args.out / tag, recipe, words, processes, args.cpu,
                              row_timeout(recipe, overrides, timeout, args.cpu), script)
            if report is None:
                rows.append({"recipe": name, "shape": shape, "processes": processes, "status": "failed",
                             "reason": why})
                print(f"{name} ({shape}): FAILED: {why}", flush=True)
                write(args.out, rows)
                continue
            result = row(name, shape, processes, report, busy)
            if resumed:  # stopped and resumed; and its memory history, in a short run of its own
                result.update(resume_check(args.out / tag, processes, args.cpu, timeout, steps, report))
                if not args.cpu:
                    snap, why = run(args.out / f"{tag}-snapshot", recipe, [*words[:-1], "max_steps=4"], processes,
                                    False, timeout, script, snapshot=True)
                    pickles = sorted(str(p) for p in (args.out / f"{tag}-snapshot").rglob("memory_snapshot_rank*.pickle"))
                    result["memory_snapshot"] = pickles or f"none: {why}"  # (open at https://pytorch.org/memory_viz)
            if "attn_implementation=sdpa" in overrides:
                auto = [r for r in rows if r["status"] == "ran" and r["shape"] == shape and r["recipe"] == recipe
                        and r["processes"] == processes]
                result.update(kernel_check(result, auto[0] if auto else None))
            rows.append(result)
            print(f"{name} ({shape}): ran, loss {result['loss_first']:.3f} -> {result['loss_last']:.3f}", flush=True)
            write(args.out, rows)
            if script == "sft" and recipe in PROFILED and not overrides:
                result["profile"] = profile_of(args.out, tag, recipe, words, processes, args.cpu, timeout)
                write(args.out, rows)
            peers = peers_of(script, recipe, overrides)
            if peers:
                rows += peer_rows(result, report, peers, report["model"], args.out, args.cpu, steps, timeout)
                for p in rows[-len(peers):]:
                    print(f"{p['recipe']} ({shape}): {p['status']} " + (f"{p['speed_ratio']:.2f}x our speed"
                          if p.get("speed_ratio") else p.get("reason", "")), flush=True)
                write(args.out, rows)
    write(args.out, rows)
    print(markdown(rows))
    print(f"wrote {args.out / 'acceptance.md'} and acceptance.json")


if __name__ == "__main__":
    main()
