"""`memrecipe compare` (commands/compare.py): runs side by side, labelled by their folders."""

def _run_folder(folder, tokens_per_second, peak):
    import json

    folder.mkdir(parents=True)
    report = {"recipe": {"name": "single-gpu-lora"}, "topology": {"processes": 1, "describe": "1 CPU process"},
              "plan": {}, "processes": [{"peak_rss_bytes": peak}], "history": [{"step": 1, "loss": 2.0}],
              "throughput": {"tokens_per_second": tokens_per_second, "mfu": None}, "final_train_loss": 1.0,
              "wall_seconds": 1.0, "output_dir": "."}  # as `memrecipe run` wrote it before: the loop runs inside
    (folder / "report.json").write_text(json.dumps(report))
    return folder


def test_compare_labels_runs_by_their_folder_and_never_merges_two(tmp_path, monkeypatch):
    from memrecipe.plots import pyplot
    from memrecipe.report import compare_rows, load

    a = _run_folder(tmp_path / "a" / "run", 1000, 2**30)
    b = _run_folder(tmp_path / "b" / "run-2", 3000, 3 * 2**30)
    reports = [load(a), load(b)]
    _, rows = compare_rows(reports)
    assert [row[0] for row in rows] == ["run", "run-2"]
    plt = pyplot()
    drawn = []
    real_bar = plt.Axes.barh
    monkeypatch.setattr(plt.Axes, "barh", lambda self, y, w, **kw: drawn.append((list(y), list(w))) or real_bar(
        self, y, w, **kw))
    from memrecipe.plots import compare_chart

    same = [load(a), load(a) | {"throughput": {"tokens_per_second": 5000}}]  # two runs with one label
    compare_chart(same, tmp_path / "c.png")
    memory, speed = drawn
    assert len(set(memory[0])) == len(set(speed[0])) == 2 and speed[1] == [1000, 5000]  # each run its own place
