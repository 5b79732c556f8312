"""training/tokenizer.py: the tokenizer beside the model, padded, with the chat template a recipe names (a file or
inline, compiled before launch), saved with the model; what cannot load is one line."""

import json

import pytest

from memrecipe.errors import RecipeError
from memrecipe.planning.registry import EMBEDDED_MODEL
from memrecipe.training.data import IGNORE
from memrecipe.training.tokenizer import check_tokenizer, load_tokenizer, read_chat_template


def test_chat_template_comes_from_the_recipe_and_a_model_without_one_names_the_key(tok, tmp_path):
    from memrecipe.training.data import _tokenize_chat

    bare = tmp_path / "bare"
    tok.save_pretrained(bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)  # where transformers 5 saves a template
    messages = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    plain = load_tokenizer(str(bare))
    assert not plain.chat_template
    with pytest.raises(RecipeError, match="no chat template: set chat_template to a Jinja file"):
        _tokenize_chat(messages, plain)
    with pytest.raises(RecipeError, match="set chat_template"):
        check_tokenizer(str(bare), chat=True)
    template = tmp_path / "turns.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    given = load_tokenizer(str(bare), chat_template=str(template))
    ids, labels = _tokenize_chat(messages, given)
    assert given.decode(ids) == "<user>Hi?</s><assistant>Hello.</s>"
    assert given.decode([t for t, label in zip(ids, labels) if label != IGNORE]) == "Hello.</s>"
    given.save_pretrained(tmp_path / "final")  # saved with the model, as the loop does
    assert load_tokenizer(str(tmp_path / "final")).chat_template == template.read_text()
    assert read_chat_template("{{ messages }}") == "{{ messages }}"  # a template given inline
    with pytest.raises(RecipeError, match="chat_template nowhere.jinja is neither a file nor a Jinja template"):
        read_chat_template("nowhere.jinja")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(EMBEDDED_MODEL))


def test_a_tokenizer_without_a_pad_token_pads_with_its_end_of_sequence(tok, tmp_path):
    config_file = tmp_path / "tokenizer_config.json"
    tok.save_pretrained(tmp_path)
    config = json.loads(config_file.read_text())
    config["pad_token"] = None
    config_file.write_text(json.dumps(config))
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == loaded.eos_token is not None


def test_a_folder_without_a_tokenizer_or_with_a_broken_template_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(RecipeError, match="has no tokenizer memrecipe can load .*tokenizer.save_pretrained"):
        check_tokenizer(str(tmp_path))
    with pytest.raises(RecipeError, match=r"the inline chat_template is not valid Jinja \(line 1"):
        read_chat_template("{% for m in messages %}{{ m }}")


def test_a_document_longer_than_the_tokenizers_maximum_is_tokenized_without_its_indexing_warning(capfd):
    """The loop cuts rows at max_seq_length and says what it cut; transformers' 'Token indices sequence length is
    longer than the specified maximum ... indexing errors' (model_max_length 512 here) is not a user's concern."""
    from memrecipe.training.loading import embedded_model
    from memrecipe.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(embedded_model())
    capfd.readouterr()
    ids = tokenizer("river stone " * 2000)["input_ids"]
    assert len(ids) > tokenizer.model_max_length
    assert "Token indices sequence length" not in "".join(capfd.readouterr())
