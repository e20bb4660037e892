"""The operator settings as the CLI and the docs show them: ``kvd serve``'s flags, with a
one-line description, allowed values, default and variable each, and the Markdown table in
docs/operations.md. Everything comes from ``Config``'s field specs (``kvd/config.py``)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from kvd.config import (  # the field specs' private accessors: this module is their other reader
    _FIELDS,
    _OPERATOR,
    CONFIG_ENV,
    _default_text,
    _env_var,
    _flag,
    _spec,
)
from kvd.settings_values import BOOLEANS_IN_WORDS, SIZES_IN_WORDS


def _help(name: str, f: dataclasses.Field[Any]) -> str:
    spec = _spec(f)
    return (f"{spec.help} [{spec.allowed_values()}; default {_default_text(f)}; "
            f"env {_env_var(name)}]").replace("%", "%%")  # (argparse formats help with %)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config PATH`` and one ``--<field-name>`` flag per operator setting (all default
    ``None``, taken as text and parsed like environment values). A development setting's
    flag is there but hidden, so that using it gets the pointer to ``KVD_DEV``."""
    group = parser.add_argument_group(
        "operator settings (flags > KVD_<KEY> env > config file > defaults)",
        f"Config-file keys are the flags' names with _; {SIZES_IN_WORDS}; "
        f"{BOOLEANS_IN_WORDS}.")
    group.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help=f"TOML config file, flat keys [env {CONFIG_ENV}]",
    )
    for name, f in _FIELDS.items():
        spec = _spec(f)
        group.add_argument(
            _flag(name),
            dest=name,
            metavar=spec.value_name(),
            type=str,
            default=None,
            help=argparse.SUPPRESS if spec.dev else _help(name, f),
        )


def operator_settings_markdown() -> str:
    """The operator settings as the Markdown table in docs/operations.md (a test keeps the
    two the same: regenerate it from here after changing a setting)."""
    rows = ["| key | allowed values | default | what it sets |", "| --- | --- | --- | --- |"]
    for name, f in _OPERATOR.items():
        spec = _spec(f)
        default = _default_text(f)
        if not spec.default_text:
            default = f"`{default}`"
        rows.append(f"| `{name}` | {spec.allowed_values()} | {default} | {spec.help} |")
    return "\n".join(rows) + "\n"
