"""Charts a person reads at a glance (matplotlib is the optional `plot` extra)."""

from __future__ import annotations

from .errors import RecipeError

COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868", "activations": "#c44e52",
          "logits": "#8172b3", "overhead": "#937860"}


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RecipeError("plots need matplotlib: pip install 'memrecipe[plot]'") from None
    return plt


def plan_chart(verdicts, gpu_memory, path) -> str:
    """Stacked bars of each recipe's memory per process, with a line at the GPU's capacity."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.6 * max(3, len(verdicts)) + 2, 4.5))
    names = [v.estimate.recipe for v in verdicts]
    bottom = [0.0] * len(verdicts)
    for category, color in COLORS.items():
        values = [getattr(v.estimate, category) / 2**30 for v in verdicts]
        ax.bar(names, values, bottom=bottom, color=color, label=category.replace("_", " "))
        bottom = [b + x for b, x in zip(bottom, values)]
    if gpu_memory and not (verdicts and verdicts[0].estimate.cpu):
        ax.axhline(gpu_memory / 2**30, color="black", linestyle="--", linewidth=1)
        ax.text(len(verdicts) - 0.5, gpu_memory / 2**30, f" GPU {gpu_memory / 2**30:.0f} GiB", va="bottom", ha="right")
    for i, v in enumerate(verdicts):
        why = "" if v.fits else " (no: GPU)" if not v.device_fits else " (no: host RAM)"
        ax.text(i, bottom[i], f"{bottom[i]:.1f}{why}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("GiB per process")
    ax.set_title("Memory per process by recipe")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise RecipeError(f"cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
    return str(path)
