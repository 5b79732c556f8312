import textwrap

import click

from ..errors import RecipeError
from ..planning.recipe import Lora, Recipe
from ..planning.registry import load_recipe, read_yaml, recipe_path
from ..planning.schema import key_rows
from ..table import terminal_width


@click.command("show")
@click.argument("recipe", required=False)
@click.option("--keys", is_flag=True, help="Print what each recipe key does (and each lora: key), with its default.")
def command(recipe, keys):
    """Print RECIPE's YAML (a name or a file), with its comments; a file with `base:`, resolved."""
    if keys:
        click.echo(key_help(terminal_width() or 100), nl=False)
        return
    if recipe is None:
        raise RecipeError("memrecipe show needs a RECIPE (a name or a file; `memrecipe ls` lists them), or --keys")
    path = recipe_path(recipe)
    resolved = load_recipe(recipe)  # refuse a broken recipe file here rather than show it as if it worked
    text = path.read_text(encoding="utf-8")
    base = (read_yaml(path) or {}).get("base")
    if base:  # every key the run will use: the base's, with this file's changes
        text = (f"# {path}: recipe {base} with this file's changes, resolved\n" + resolved.to_yaml())
    width = terminal_width()  # in a terminal, long comments wrap; piped to a file, the YAML is as shipped
    click.echo(wrap_comments(text, width) if width else text, nl=False)


def wrap_comments(text: str, width: int) -> str:
    """Wrap each line's trailing comment onto comment lines aligned under it: still the same YAML."""
    out = []
    for line in text.splitlines():
        code, hash_, comment = line.partition("# ")
        if len(line) <= width or not hash_ or len(code) > width - 20:
            out.append(line)
            continue
        pieces = textwrap.wrap(comment, width - len(code) - 2) or [""]
        out.append(f"{code}# {pieces[0]}")
        out += [f"{' ' * len(code)}# {piece}" for piece in pieces[1:]]
    return "\n".join(out) + "\n"


def key_help(width: int) -> str:
    """The recipe keys' help (their fields' metadata, as docs/configs.md's tables), wrapped to `width`."""
    out = []
    for title, cls in (("recipe keys", Recipe), ("lora: keys", Lora)):
        out.append(f"{title} (default in parentheses):")
        for names, default, help in key_rows(cls):
            out.append(f"  {names.replace('`', '')} ({default.replace('`', '')})")
            out += textwrap.wrap(help.replace("`", ""), width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(out) + "\n"
