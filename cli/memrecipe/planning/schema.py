"""Build frozen dataclasses from plain dicts, refusing what does not fit with a one-line error.

Each field's type hint is the schema; `spec(...)` adds ranges. Errors name the dotted key path,
what is allowed, and a did-you-mean for near-miss keys and choices.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from dataclasses import field
from typing import Any, Literal, Union

from ..errors import RecipeError, did_you_mean


def spec(default: Any = dataclasses.MISSING, *, low=None, high=None, low_open=False, help="", shown="", keys=None,
         row=True) -> Any:
    """A dataclass field with an allowed range (low <= value, < if low_open, and value <= high) and its help: `help`
    (what the key does, for docs/configs.md and `memrecipe show --keys`), `shown` (its default as the table says it),
    `keys` (the table's key cell where one row describes several keys); row=False: described in another key's row."""
    meta = {"low": low, "high": high, "low_open": low_open, "help": help, "shown": shown, "keys": keys, "row": row}
    if isinstance(default, (list, dict, tuple)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def key_rows(cls) -> list[tuple[str, str, str]]:
    """(keys, default, what it does) for each row of a section's key table, from its fields' help."""
    return [(f.metadata.get("keys") or f"`{f.name}`", f.metadata.get("shown", ""), f.metadata.get("help", ""))
            for f in dataclasses.fields(cls) if f.metadata.get("row", True)]


def build(cls, data: Any, path: str = ""):
    """Validate `data` (a dict from YAML) against dataclass `cls`; returns a frozen instance."""
    where = path or "the recipe"
    if not isinstance(data, dict):
        raise RecipeError(f"{where} must be a mapping of keys to values, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            full = f"{path}.{key}" if path else str(key)
            # a section's key given outside its section (`beta` for `dpo.beta`), a near-miss of a key here (its name
            # alone: the path they share says nothing), or a key here it lengthens (`rank` for `r`)
            close = _section_keys(hints, str(key)) or difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6) \
                or [n for n in fields if str(key).startswith(n)][:1]
            meant = " or ".join(repr(f"{path}.{n}" if path else n) for n in close)
            raise RecipeError(f"unknown key {full!r}{f' (did you mean {meant}?)' if close else ''}; allowed here: "
                              f"{', '.join(fields)}")
    values = {}
    for name, f in fields.items():
        key = f"{path}.{name}" if path else name
        if name in data:
            values[name] = _coerce(hints[name], data[name], key, f.metadata)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecipeError(f"missing required key {key!r}")
    return cls(**values)


def _section_keys(hints: dict, key: str) -> list[str]:
    """The sections' keys named `key` ("section.key"): a section's key given at the top (`beta` for `dpo.beta`)."""
    return [f"{name}.{key}" for name, hint in hints.items()
            for arm in (typing.get_args(hint) or (hint,))
            if dataclasses.is_dataclass(arm) and key in {f.name for f in dataclasses.fields(arm)}]


def _coerce(hint, value, key, meta):
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        arms = typing.get_args(hint)
        if value is None:
            if type(None) in arms:
                return None
            raise RecipeError(f"{key} must not be null; expected {_describe(hint)}")
        # a list or a mapping can only be meant for the arm of its kind: that arm's error is the useful one
        kind = [a for a in arms if (typing.get_origin(a) is tuple and isinstance(value, (list, tuple)))
                or (dataclasses.is_dataclass(a) and isinstance(value, dict))]
        if len(kind) == 1:
            return _coerce(kind[0], value, key, meta)
        errors = []
        for arm in (a for a in arms if a is not type(None)):
            try:
                return _coerce(arm, value, key, meta)
            except RecipeError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        literal = [e for a, e in zip((a for a in arms if a is not type(None)), errors) if typing.get_origin(a) is Literal]
        if isinstance(value, str) and len(literal) == 1:  # a near-miss of a named choice: say which it meant
            raise RecipeError(f"{key} must be {_describe(hint)}, got {_show(value)}{did_you_mean(value, _choices(hint))}")
        raise RecipeError(f"{key} must be {_describe(hint, meta)}, got {_show(value)}")
    if origin is Literal:
        choices = typing.get_args(hint)
        if value is False and "no" in choices:  # YAML 1.1 reads a bare `no` as false
            return "no"
        if value in choices and type(value) is type(choices[choices.index(value)]):
            return value
        listed = ", ".join(str(c) for c in choices)
        raise RecipeError(f"{key} must be one of {listed}, got {_show(value)}{did_you_mean(str(value), choices)}")
    if origin is tuple:
        (item,) = typing.get_args(hint)[:1]
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{key} must be a list, got {_show(value)}")
        return tuple(_coerce(item, v, f"{key}[{i}]", {}) for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        return build(hint, {} if value is None else value, key)
    if hint is dict:  # an open mapping: any YAML under it, read by whoever asked for it (a copied script)
        if value is None or isinstance(value, dict):
            return dict(value or {})
        raise RecipeError(f"{key} must be a mapping of keys to values, got {_show(value)}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise RecipeError(f"{key} must be true or false, got {_show(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise RecipeError(f"{key} must be a string, got {_show(value)}")
    if hint in (int, float):
        return _check_range(_number(hint, value, key), key, meta)
    raise TypeError(f"schema type {hint!r} for {key} is not supported")  # a bug in the schema, not user input


def _number(hint, value, key):
    # PyYAML reads `2e-5` as a string (YAML 1.1 wants `2.0e-5`); accept it, it is what users write.
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "an integer" if hint is int else "a number"
        raise RecipeError(f"{key} must be {kind}, got {_show(value)}")
    if hint is int:
        if value != int(value):
            raise RecipeError(f"{key} must be an integer, got {value!r}")
        return int(value)
    return float(value)


def _check_range(value, key, meta):
    low, high, low_open = meta.get("low"), meta.get("high"), meta.get("low_open")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        raise RecipeError(f"{key} must be {_allowed(meta)}, got {value!r}")
    return value


def _allowed(meta) -> str:
    """'>= 2', '> 0 and <= 1': a number's range from its field's spec."""
    low, high, low_open = meta.get("low"), meta.get("high"), meta.get("low_open")
    left = "" if low is None else (f"> {low}" if low_open else f">= {low}")
    right = "" if high is None else f"<= {high}"
    return " and ".join(p for p in (left, right) if p)


def _describe(hint, meta=None) -> str:
    """The values a type takes, in words (a number's with its range, from `meta`)."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a, meta) for a in typing.get_args(hint))
    if hint in (int, float) and meta and _allowed(meta):
        return f"{'an integer' if hint is int else 'a number'} {_allowed(meta)}"
    if origin is Literal:
        return "one of " + ", ".join(str(c) for c in typing.get_args(hint))
    if origin is tuple:
        return "a list"
    if hint is type(None):
        return "null"
    if dataclasses.is_dataclass(hint) or hint is dict:
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def _choices(hint) -> list:
    return [c for a in typing.get_args(hint) if typing.get_origin(a) is Literal for c in typing.get_args(a)]


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def to_dict(obj) -> dict:
    """A plain dict (lists, not tuples) of a built dataclass, ready for yaml.safe_dump."""

    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return typing.cast(dict, plain(dataclasses.asdict(obj)))
