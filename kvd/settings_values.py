"""How a setting's value is read and checked: kinds (string, integer, size, seconds,
boolean) and checks, each of which also says in words what it allows (for ``--help`` and
the operator's guide), and :class:`Spec`, one setting's kind, checks and description.

A kind reads a value two ways: from text (environment, flags, ``KVD_DEV``) and from a typed
TOML value (what text each accepts: ``SIZES_IN_WORDS``, ``_TRUE``/``_FALSE``; a size may
have a fraction when the bytes are whole: ``"1.5GiB"``, not ``"0.1KiB"``). A check takes
the parsed value and returns it (possibly normalised) or raises :class:`InvalidValue`,
whose message is the reason without the key or the source (the loader adds those).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from kvd.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# Bare letters and binary units are 1024-based, ``KB MB GB TB`` 1000-based.
_SIZE_UNITS: dict[str, int] = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgt", start=1):
    _SIZE_UNITS.update({_letter: 1024**_power, f"{_letter}ib": 1024**_power,
                        f"{_letter}b": 1000**_power})
_SIZE_RE = re.compile(r"\s*([+-]?)(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_INT_RE = re.compile(r"\s*[+-]?\d+\s*")
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


class InvalidValue(Exception):
    """A value failed to parse or check; the message is the reason, without key or source."""


def describe(value: object) -> str:
    """A short, one-line rendering of a bad value for an error message."""
    if isinstance(value, bool):
        text = f"boolean {str(value).lower()}"
    elif isinstance(value, str):
        text = repr(value)
    elif isinstance(value, (int, float)):
        text = f"{type(value).__name__} {value!r}"
    elif isinstance(value, list):
        text = f"array {value!r}"
    elif isinstance(value, dict):
        text = "table"
    else:
        text = f"{type(value).__name__} {value!r}"
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------------------- kinds


def _size_from_text(text: str) -> int:
    match = _SIZE_RE.fullmatch(text)
    if match is None or match.group(3).lower() not in _SIZE_UNITS:
        raise InvalidValue(
            f"expected a size such as 4096, '64KiB', '1.5GiB' or '2GB', got {text!r}")
    sign, number, unit = match.groups()
    amount = Fraction(number) * _SIZE_UNITS[unit.lower()]
    if sign == "-" and amount != 0:
        raise InvalidValue(f"must be >= 0, got {text.strip()}")
    if amount.denominator != 1:
        raise InvalidValue(f"must be a whole number of bytes, got {text.strip()!r}")
    return int(amount)


def _size_from_value(value: object) -> int:
    if isinstance(value, str):
        return _size_from_text(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise InvalidValue(f"must be >= 0, got {value}")
        return value
    raise InvalidValue(f"expected an integer or a size string, got {describe(value)}")


def _int_from_text(text: str) -> int:
    if _INT_RE.fullmatch(text) is None:
        raise InvalidValue(f"expected an integer, got {text!r}")
    return int(text)


def _finite_seconds(value: float) -> float:
    if not math.isfinite(value):
        raise InvalidValue(f"expected a finite number of seconds, got {value}")
    return value


def _seconds_from_text(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InvalidValue(f"expected a number of seconds, got {text!r}") from None
    return _finite_seconds(value)


def _seconds_from_value(value: object) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _finite_seconds(float(value))
    raise InvalidValue(f"expected a number of seconds, got {describe(value)}")


def _bool_from_text(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise InvalidValue(f"expected a boolean (true/false, 1/0, yes/no, on/off), got {text!r}")


def _exactly(kind: type, words: str) -> Callable[[object], Any]:
    """A TOML value of type ``kind``, as it is (a boolean is no integer)."""
    def read(value: object) -> Any:
        if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            return value
        raise InvalidValue(f"expected {words}, got {describe(value)}")

    return read


@dataclass(frozen=True)
class Kind:
    """How one type of setting is read: from text (env, flags) and from a typed value
    (TOML); ``allowed`` names it for a reader, ``metavar`` stands for a value in ``--help``
    where the setting names nothing more telling."""

    name: str
    allowed: str
    from_text: Callable[[str], Any]
    from_value: Callable[[object], Any]
    metavar: str


STR = Kind("string", "text", str, _exactly(str, "a string"), "TEXT")
INT = Kind("integer", "an integer", _int_from_text, _exactly(int, "an integer"), "N")
SIZE = Kind("size", "a size", _size_from_text, _size_from_value, "SIZE")
SECONDS = Kind("seconds", "seconds", _seconds_from_text, _seconds_from_value, "SECONDS")
BOOL = Kind("boolean", "true or false", _bool_from_text, _exactly(bool, "a boolean"),
            "true|false")


SIZES_IN_WORDS = ("sizes are bytes, or a number with a unit: KiB, MiB, GiB, TiB (or K, M, G, T), "
                  "KB, MB, GB, TB (1000-based)")
BOOLEANS_IN_WORDS = "booleans are true/false, 1/0, yes/no or on/off"


# --------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class Check:
    """One rule a value must follow. ``apply`` returns the value (possibly normalised) or
    raises :class:`InvalidValue`; ``allowed`` is the rule in words, following the kind's
    name ("an integer" + "in 0..65535"), or, with ``whole``, on its own (a list of
    choices); ``metavar``, if any, stands for a value in ``--help`` ("PORT")."""

    allowed: str
    apply: Callable[[Any], Any]
    whole: bool = False
    metavar: str = ""


def _rule(allowed: str, ok: Callable[[Any], Any], complaint: str, metavar: str = "") -> Check:
    """A check that lets a value through if ``ok(value)``; ``complaint`` (formatted with
    ``value``) says why it did not."""
    def apply(value: Any) -> Any:
        if not ok(value):
            raise InvalidValue(complaint.format(value=value))
        return value

    return Check(allowed, apply, metavar=metavar)


def at_least(low: float, shown: str | None = None) -> Check:
    return _rule(f">= {shown or low}", lambda v: v >= low, f"must be >= {low}, got {{value}}")


POSITIVE = _rule("> 0", lambda v: v > 0, "must be > 0, got {value}")
PORT = _rule("in 0..65535 (0: any free port)", lambda v: 0 <= v <= 65535,
             "must be a port in 0..65535, got {value}", metavar="PORT")
POWER_OF_TWO = _rule("a power of two", lambda v: v > 0 and not v & (v - 1),
                     "must be a power of two, got {value}")
# (no words: the field's own say what it holds)
NON_EMPTY = _rule("", lambda v: v.strip(), "must not be empty")
NO_WHITESPACE = _rule("", lambda v: not any(ch.isspace() for ch in v),
                      "must not contain whitespace, got {value!r}")


def one_of(*choices: str) -> Check:
    """A word from ``choices``, case-insensitive."""
    def apply(value: str) -> str:
        choice = value.strip().lower()
        if choice not in choices:
            raise InvalidValue(f"must be one of {', '.join(choices)}, got {value!r}")
        return choice

    return Check(f"{', '.join(choices[:-1])} or {choices[-1]}", apply, whole=True,
                 metavar="|".join(choices))


# --------------------------------------------------------------------------- a setting


@dataclass(frozen=True)
class Spec:
    """One setting: how it is read and checked, what it is for (``help``, one line), and
    whether it is a development setting."""

    kind: Kind
    checks: tuple[Check, ...]
    help: str  # one line: what the setting is for
    dev: bool = False  # a development setting: only from KVD_DEV
    default_from_env: Callable[[Mapping[str, str]], Any] | None = None
    default_text: str = ""  # the default in words: a computed one, or what empty means
    allowed: str = ""  # the allowed values in words, where the checks' own words fall short
    metavar: str = ""  # what stands for a value in --help, where the checks' fall short

    def from_text(self, text: str) -> Any:
        return self._check(self.kind.from_text(text))

    def from_value(self, value: object) -> Any:
        return self._check(self.kind.from_value(value))

    def allowed_values(self) -> str:
        if self.allowed:
            return self.allowed
        for check in self.checks:
            if check.whole:
                return check.allowed
        words = ", ".join(c.allowed for c in self.checks if c.allowed)
        return " ".join([self.kind.allowed, words]).strip()

    def value_name(self) -> str:
        """What stands for a value in ``--help``: ``PORT``, ``debug|info|...``, ``SIZE``."""
        return self.metavar or next((c.metavar for c in self.checks if c.metavar),
                                    self.kind.metavar)

    def _check(self, value: Any) -> Any:
        for check in self.checks:
            value = check.apply(value)
        return value


# --------------------------------------------------------------------------- sizes


def parse_size(text: str | int) -> int:
    """Parse a byte size: an int >= 0, or a string like ``"4096"``, ``"64KiB"``, ``"1.5GiB"``,
    ``"2GB"`` (decimal) or ``"512M"`` (bare letters are binary). Raises ConfigError."""
    try:
        return _size_from_value(text)
    except InvalidValue as exc:
        raise ConfigError(str(exc)) from None


def format_size(size_bytes: int) -> str:
    """The shortest exact binary rendering: 1073741824 -> ``"1GiB"``, 1000 -> ``"1000"``."""
    for unit, factor in (("TiB", 1024 * GiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if size_bytes and size_bytes % factor == 0:
            return f"{size_bytes // factor}{unit}"
    return str(size_bytes)
