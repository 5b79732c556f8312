"""plots.py: the plan's stacked bars are the estimate's categories in GiB, the loss plot draws what the history
holds, and a path that cannot be written is one line."""

import pytest

from memrecipe import plots
from memrecipe.errors import RecipeError
from memrecipe.planning.architecture import structure
from memrecipe.planning.planner import estimate, judge
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology
from memrecipe.units import GiB
from model_configs import LLAMA_8B


@pytest.fixture
def drawn(monkeypatch):
    """The figure a chart function would save, kept open to be read."""
    figures = []
    monkeypatch.setattr(plots, "save", lambda plt, fig, path: figures.append(fig) or str(path))
    return figures


def test_each_recipes_bar_stacks_its_categories_in_gib_under_the_gpus_line(drawn, tmp_path):
    s = structure(LLAMA_8B)
    verdicts = [judge(estimate(load_recipe(name), s, Topology(1)), 80 * 10**9, None)
                for name in ("single-gpu-lora", "single-gpu-full")]
    plots.plan_chart(verdicts, 80 * 10**9, tmp_path / "plan.png")
    ax = drawn[0].axes[0]
    bars = [p for p in ax.patches]
    for i, v in enumerate(verdicts):  # one stack per recipe, bottom to top in COLORS' order
        heights = [b.get_height() for b in bars[i::len(verdicts)]]
        assert heights == pytest.approx([getattr(v.estimate, c) / GiB for c in plots.COLORS])
    assert [line.get_ydata()[0] for line in ax.lines] == [pytest.approx(80e9 / GiB)]


def test_the_loss_plot_draws_train_and_eval_loss_and_the_learning_rate(drawn, tmp_path):
    history = [{"step": s, "loss": 3.0 - s / 10, "lr": 1e-4 * s} | ({"eval_loss": 2.9} if s == 4 else {})
               for s in range(1, 5)]
    plots.plot_loss({"history": history, "recipe": {"name": "fsdp"}, "topology": {"describe": "2 CPU processes"}},
                    tmp_path / "loss.png")
    loss, lr = drawn[0].axes
    train, evals = loss.lines
    assert list(train.get_ydata()) == [h["loss"] for h in history] and list(evals.get_xdata()) == [4]
    assert list(lr.lines[0].get_ydata()) == [h["lr"] for h in history]


def test_a_chart_is_written_as_a_png_and_an_unwritable_path_is_one_line(tmp_path):
    s = structure(LLAMA_8B)
    verdicts = [judge(estimate(load_recipe("single-gpu-lora"), s, Topology(1)), 24 * GiB, None)]
    path = plots.plan_chart(verdicts, 24 * GiB, tmp_path / "plan.png")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(RecipeError, match="cannot write .*nowhere/plan.png"):
        plots.plan_chart(verdicts, 24 * GiB, tmp_path / "nowhere" / "plan.png")
