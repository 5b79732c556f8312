"""The tokenizer beside the model, with the chat template a recipe names, checked before launch."""

from __future__ import annotations

from pathlib import Path

from ..errors import RecipeError


def check_tokenizer(name_or_path: str, trust_remote_code: bool = False, chat_template: str | None = None,
                    chat: bool = False):
    """A loadable tokenizer beside the model (with a chat template if `chat` data needs one), or a one-line
    error (before anything is launched). Returns it."""
    from .data import NO_TEMPLATE

    try:
        tokenizer = load_tokenizer(name_or_path, trust_remote_code, chat_template)
    except RecipeError:
        raise
    except Exception as e:  # sentencepiece, tiktoken, missing files: each library raises its own kind
        text = " ".join(str(e).split())[:200]
        raise RecipeError(f"model {name_or_path} has no tokenizer memrecipe can load (save it beside the model with "
                          f"tokenizer.save_pretrained, e.g. tokenizer.json): {text}") from None
    if chat and not tokenizer.chat_template:
        raise RecipeError(f"model {name_or_path}: {NO_TEMPLATE}")
    return tokenizer


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, chat_template: str | None = None):
    """The model's tokenizer; `chat_template` (a Jinja file, or the template itself) replaces its own,
    and is saved with it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:  # padding is masked out of the loss, any token will do
        tokenizer.pad_token = tokenizer.eos_token
    # its "Token indices sequence length is longer than the specified maximum ... indexing errors" on every long
    # document: the loop cuts rows at max_seq_length itself and counts what it cut (transformers warns once per
    # tokenizer, keyed by this flag)
    tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    if chat_template:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(value: str) -> str:
    """The recipe's chat_template: a Jinja template given inline, or the text of a file; compiled here, as
    transformers compiles it (its sandbox and extensions), so that a broken one is refused before launch."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    inline = "{%" in value or "{{" in value
    path = Path(value).expanduser()
    if not inline and not path.is_file():
        raise RecipeError(f"chat_template {value} is neither a file nor a Jinja template ({{% ... %}})")
    text = value if inline else path.read_text(encoding="utf-8")
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as e:
        where = "the inline chat_template" if inline else f"chat_template {value}"
        raise RecipeError(f"{where} is not valid Jinja (line {e.lineno}: {e.message})") from None
    return text
