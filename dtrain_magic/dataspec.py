"""``--data NAME=SOURCE``: how a run names its data sources, as text (pure; `RunConfig` validates with it).

``NAME`` is what the function reads (``ctx.data("train", ...)``); ``SOURCE`` is a notebook variable (a Spark
DataFrame, a Ray Dataset, a pandas DataFrame, a pyarrow Table, a numpy array, a torch tensor, a dict of
arrays) or a path/URI of Parquet files. A ``[col,col]`` suffix keeps only those columns of the source
(``--data train=df[x,y]``), for sources that also hold columns no tensor can be made of (strings, dates).
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Callable, Iterator, Mapping

from .errors import ConfigError

FLAG = "--data"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_COLUMNS = re.compile(r"^(?P<source>.+)\[(?P<columns>[^\[\]]*)\]$")

DataSpecs = tuple[tuple[str, str], ...]


def parse_item(text: str) -> tuple[str, str]:
    """One ``NAME=SOURCE`` → ``(name, source)``; argparse's ``type`` for ``--data`` (its error names the form)."""
    name, sep, source = _unquote(str(text).strip()).partition("=")
    name, source = name.strip(), _unquote(source.strip())
    if not sep or not name or not source:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=SOURCE (e.g. --data train=df_train)")
    return name, source


def _unquote(text: str) -> str:
    """IPython splits a magic's line keeping quotes: ``'val=/my data'`` (as a flag line writes it) or
    ``val='/my data'`` (as a user may) lose one pair."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _pairs(value: Any, flag: str, parse: Callable[[str], tuple[str, str]], form: str) -> Iterator[tuple[Any, Any]]:
    """The ``(name, value)`` pairs of a ``NAME=VALUE`` flag's value as `RunConfig` takes it: None, a mapping,
    ``"NAME=VALUE"`` strings (read by ``parse``) or pairs; anything else is a `ConfigError` naming ``flag``."""
    if value is None:
        return
    if isinstance(value, str):
        value = [value]
    for item in value.items() if isinstance(value, Mapping) else value:
        if isinstance(item, str):
            try:
                item = parse(item)
            except argparse.ArgumentTypeError as exc:
                raise ConfigError(flag, str(exc)) from None
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ConfigError(flag, f"got {item!r}; give {form}")
        yield item[0], item[1]


def _is_identifier(text: Any) -> bool:
    """A data or output name, or a variable ``--output`` binds: a Python identifier (`ctx.data`, `ctx.write`)."""
    return isinstance(text, str) and bool(_NAME.match(text))


def _given_once(flag: str, values: list, each: str) -> None:
    """A `ConfigError` naming ``flag`` for the values given more than once (``each``: what the message asks)."""
    twice = sorted({value for value in values if values.count(value) > 1})
    if twice:
        raise ConfigError(flag, f"{', '.join(twice)} given twice; {each}")


def normalize(value: Any) -> DataSpecs:
    """What `RunConfig` keeps of ``data``: ``((name, source), ...)`` in the order given.

    Takes None, a mapping ``{name: source}``, ``"NAME=SOURCE"`` strings or ``(name, source)`` pairs; a name
    given twice, a name that is not an identifier or an empty source is a `ConfigError` naming ``--data``."""
    specs: list[tuple[str, str]] = []
    for name, source in _pairs(value, FLAG, parse_item, "NAME=SOURCE (a name and a notebook variable, path or URI)"):
        if not _is_identifier(name):
            raise ConfigError(FLAG, f"got the name {name!r}; a data name must be a Python identifier "
                                    "(letters, digits, _), as ctx.data(NAME) reads it")
        if not isinstance(source, str) or not source.strip():
            raise ConfigError(FLAG, f"{name}={source!r}: the source must be a notebook variable's name, a path or "
                                    "a URI")
        specs.append((name, source.strip()))
    _given_once(FLAG, [name for name, _ in specs], "each data name once")
    for name, source in specs:
        split_columns(name, source)  # a malformed [col,...] suffix is an error now
    return tuple(specs)


def split_columns(name: str, source: str) -> tuple[str, tuple[str, ...] | None]:
    """``"df[x, y]"`` → ``("df", ("x", "y"))``; a source without the suffix → ``(source, None)``."""
    match = _COLUMNS.match(source)
    if match is None:
        return source, None
    columns = tuple(c.strip() for c in match.group("columns").split(",") if c.strip())
    if not columns:
        raise ConfigError(FLAG, f"{name}={source}: name the columns to keep between the brackets, e.g. "
                                f"{name}={match.group('source')}[x,y]")
    return match.group("source").strip(), columns


def as_text(specs: DataSpecs) -> str:
    """``train=df val=/data/val``: the specs as one line (MLflow's param, the panel's text box)."""
    return " ".join(f"{name}={source}" for name, source in specs)


def from_text(text: str) -> DataSpecs:
    """The panel's text box back into specs: ``NAME=SOURCE`` items separated by spaces."""
    return normalize(text.split())


OUTPUT_FLAG = "--output"


def parse_output(text: str) -> tuple[str, str]:
    """One ``NAME=VARIABLE`` of ``--output`` → ``(name, variable)``; argparse's ``type`` for it."""
    name, sep, variable = _unquote(str(text).strip()).partition("=")
    name, variable = name.strip(), variable.strip()
    if not sep or not name or not variable:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VARIABLE (e.g. --output preds=df_preds)")
    return name, variable


def normalize_outputs(value: Any) -> DataSpecs:
    """What `RunConfig` keeps of ``outputs`` (``--output NAME=VARIABLE``): ``((name, variable), ...)``. Takes None, a
    mapping, ``"NAME=VARIABLE"`` strings or pairs; both must be Python identifiers, each output and each variable
    once: a `ConfigError` naming ``--output`` otherwise."""
    specs: list[tuple[str, str]] = []
    for name, variable in _pairs(value, OUTPUT_FLAG, parse_output, "NAME=VARIABLE (the name ctx.write(NAME, ...) "
                                 "writes, the notebook variable it is bound to)"):
        for what, text in (("output name", name), ("variable", variable)):
            if not _is_identifier(text):
                raise ConfigError(OUTPUT_FLAG, f"got the {what} {text!r} in {name}={variable}; it must be a Python "
                                               "identifier (letters, digits, _)")
        specs.append((name, variable))
    for index in (0, 1):
        _given_once(OUTPUT_FLAG, [spec[index] for spec in specs], "each output and each variable once")
    return tuple(specs)


OUTPUTS_KEYWORD = "outputs="


def output_names(value: Any) -> DataSpecs:
    """`dtrain_magic.run`'s ``outputs=`` (an output's name, or a list of names) as `RunConfig` keeps ``--output``:
    ``((name, name), ...)``, each name also its key in ``RunResult.tables`` (no notebook variable to bind). None:
    none. Anything but identifiers, each once, is a `ConfigError` naming ``outputs=``."""
    if value is None:
        return ()
    names = [value] if isinstance(value, str) else value
    if isinstance(names, Mapping) or not isinstance(names, (list, tuple, set, frozenset)):
        raise ConfigError(OUTPUTS_KEYWORD, f"got {value!r}; give the name ctx.write(NAME, ...) writes, or a list of "
                                           "them (outputs=['preds']): each comes back as result.tables[NAME]")
    for name in names:
        if not _is_identifier(name):
            raise ConfigError(OUTPUTS_KEYWORD, f"got the output name {name!r}; it must be a Python identifier "
                                               "(letters, digits, _), the name ctx.write(NAME, ...) writes")
    _given_once(OUTPUTS_KEYWORD, list(names), "each output once")
    return tuple((name, name) for name in names)
