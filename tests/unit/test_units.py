"""Memory sizes as people write them: GB = 10^9, GiB = 2^30; anything else refused in one line."""

import pytest

from memrecipe.errors import RecipeError
from memrecipe.units import parse_size


@pytest.mark.parametrize("text, value", [("24GB", 24 * 10**9), ("24 GiB", 24 * 2**30), ("24GiB", 24 * 2**30),
                                         ("1.5TiB", int(1.5 * 2**40)), ("512mib", 512 * 2**20)])
def test_memory_sizes_parse(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["lots", "24", "24 GiBs", "", "-3GB"])
def test_bad_memory_sizes_are_refused(text):
    with pytest.raises(RecipeError, match="not a size"):
        parse_size(text)
