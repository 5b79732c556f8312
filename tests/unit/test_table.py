"""table.py: plain-text tables a person reads at a glance."""

from memrecipe.table import table


def test_columns_line_up_under_their_headers_and_wrap_where_asked():
    out = table(["RECIPE", "SAVES"], [["fsdp", "shards everything over the GPUs"], ["zero3-offload", "all"]],
                widths={1: 12}).splitlines()
    assert out[0] == "RECIPE         SAVES" and out[1] == "-------------  ----------"
    assert out[2:] == ["fsdp           shards", "               everything", "               over the", "               GPUs",
                       "zero3-offload  all"]
