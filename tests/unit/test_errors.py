"""errors.py: the one kind of error a user sees, and the nearest right word offered beside a wrong one."""

from memrecipe.errors import RecipeError, did_you_mean


def test_a_close_word_is_offered_and_a_far_one_is_not():
    assert did_you_mean("zero3-ofload", ["zero3-offload", "fsdp"]) == " (did you mean 'zero3-offload'?)"
    assert did_you_mean("grpo", ["sft", "dpo"]) == ""
    assert did_you_mean(0.95, [0.9, "auto"]) == " (did you mean '0.9'?)"  # YAML's numbers compared as written


def test_a_recipe_error_is_a_value_error():
    """Click and the loop catch it as bad input (exit 2, one line), callers that know nothing of memrecipe as a
    ValueError."""
    assert issubclass(RecipeError, ValueError)
