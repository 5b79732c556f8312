"""Charts a person reads at a glance (matplotlib, part of the base install)."""

from __future__ import annotations

from pathlib import Path

from .errors import RecipeError
from .units import GiB

# the plan's stacked bars: model states, activations and logits at their joint peak (`working`), overhead
COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868", "working": "#c44e52",
          "overhead": "#937860"}
LABELS = {"working": "activations + logits (at their peak)"}


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RecipeError("plots need matplotlib (a dependency of memrecipe): pip install matplotlib") from None
    return plt


def plan_chart(verdicts, gpu_memory, path) -> str:
    """Stacked bars of each recipe's memory per process, with a line at the GPU's capacity."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.6 * max(3, len(verdicts)) + 2, 4.5))
    names = [v.estimate.recipe for v in verdicts]
    bottom = [0.0] * len(verdicts)
    for category, color in COLORS.items():
        values = [getattr(v.estimate, category) / GiB for v in verdicts]
        ax.bar(names, values, bottom=bottom, color=color, label=LABELS.get(category, category.replace("_", " ")))
        bottom = [b + x for b, x in zip(bottom, values)]
    if gpu_memory and not (verdicts and verdicts[0].estimate.cpu):
        ax.axhline(gpu_memory / GiB, color="black", linestyle="--", linewidth=1)
        # in both units: "80GB" is 80e9 bytes, 74.5 GiB, and the bars are in GiB
        ax.text(len(verdicts) - 0.5, gpu_memory / GiB, f"GPU memory: {gpu_memory / 1e9:.0f} GB = {gpu_memory / GiB:.1f} GiB",
                va="bottom", ha="right")
    for i, v in enumerate(verdicts):
        why = "" if v.fits else "\nover the GPU" if not v.device_fits else "\nover host RAM"
        ax.text(i, bottom[i], f"{bottom[i]:.1f} GiB{why}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("GiB per process")
    ax.set_title("Memory per process by recipe")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save(plt, fig, path)


def save(plt, fig, path) -> str:
    """Write the figure (a one-line error if the path cannot be written) and free it."""
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise RecipeError(f"cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
    return str(path)


def plot_loss(report: dict, path) -> str | None:
    """loss.png: train (and eval) loss and the learning rate over steps; None without matplotlib."""
    try:
        plt = pyplot()
    except RecipeError:
        return None
    history = report["history"]
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [h["loss"] for h in history], label="train loss", color="#4c72b0")
    evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", color="#c44e52")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss per target token")
    lr = ax.twinx()
    lr.plot(steps, [h["lr"] for h in history], label="learning rate", color="#999999", linestyle="--")
    lr.set_ylabel("learning rate")
    handles = ax.get_legend_handles_labels()[0] + lr.get_legend_handles_labels()[0]
    ax.legend(handles, [str(h.get_label()) for h in handles], loc="upper right")
    ax.set_title(f"{report['recipe']['name']}: {report['topology']['describe']}")
    return save(plt, fig, path)


def peak_key(process: dict) -> str:
    """The peak a process record has: the CUDA allocator's on GPUs, peak RSS on CPU (measure.peak_memory)."""
    return "cuda_max_allocated_bytes" if "cuda_max_allocated_bytes" in process else "peak_rss_bytes"


def compare_chart(reports: list[dict], path) -> str:
    """Bars per run, one row each (a run folder's name, as runs/<recipe>-<time>, is long: read across, not under
    a bar): peak memory per process and tokens/s, each bar with its value."""
    plt = pyplot()
    names = [f"{Path(r['output_dir']).name} ({r['recipe']['name']})" for r in reports]
    at = list(range(len(reports)))  # one bar per run, at its own place: equal labels never merge two runs
    fig, (mem, speed) = plt.subplots(1, 2, sharey=True, figsize=(12, 1.2 + 0.45 * len(reports)))
    peaks = [max(p[peak_key(r["processes"][0])] for p in r["processes"]) / GiB for r in reports]
    rates = [r["throughput"]["tokens_per_second"] for r in reports]
    rss = " (RSS, on CPU)" if any(peak_key(r["processes"][0]) == "peak_rss_bytes" for r in reports) else ""
    for ax, values, color, label, text in [(mem, peaks, "#4c72b0", f"peak GiB per process{rss}", "{:.2f} GiB"),
                                           (speed, rates, "#55a868", "tokens / s (real, all processes)", "{:,.0f}")]:
        ax.barh(at, values, color=color)
        ax.bar_label(ax.containers[0], [text.format(v) for v in values], padding=3, fontsize=8)
        ax.set_xlabel(label)
        ax.set_xlim(0, max(values, default=0) * 1.25 or 1)  # room for the labels
    mem.set_yticks(at, names, fontsize=8)
    mem.invert_yaxis()  # the first run named on top, as the table lists them
    return save(plt, fig, path)
