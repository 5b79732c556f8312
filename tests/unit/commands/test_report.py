"""`memrecipe report` (commands/report.py): a folder without a whole report.json is one line naming what is wrong."""


def test_a_folder_without_a_whole_report_is_one_line(cli, tmp_path):
    none = cli("report", str(tmp_path))
    assert none.returncode == 2 and "has no report.json: is it a finished memrecipe run folder?" in none.stderr
    (tmp_path / "report.json").write_text('{"recipe": ')
    cut = cli("report", str(tmp_path))
    assert cut.returncode == 2 and "is not valid JSON" in cut.stderr and "cut off" in cut.stderr
    (tmp_path / "report.json").write_text("{}")
    old = cli("report", str(tmp_path))
    assert old.returncode == 2 and "lacks" in old.stderr and "Traceback" not in old.stderr
