"""One declaration per option (STYLE.md, "vLLM's config"): a dataclass field that is also a
command-line flag carries its flags, help and check in the field's metadata, written once.

    @dataclass
    class SessionConfig:
        n_ctx: int = option("-c", "--ctx-size", default=0, help="context size, 0 = the model's",
                            check=at_least(0, "0: the model's"))

    for name, f, opt in declared(SessionConfig): ...   # the CLI builds its typer parameters from these

The front end (cli/options.py) turns every declared field into a typer option of the same name
and type, runs `check` on the parsed value (a ValueError's message is the one-line error), and
hands the values to the dataclass as they are. Nothing here imports the rest of spac.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import MISSING
from typing import Any


@dataclasses.dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]          # llama.cpp's names: ("-c", "--ctx-size"), ("--exact/--no-exact",)
    help: str
    group: str = "model"            # which block of flags a command asks for (run_options)
    check: Callable[[Any], Any] | None = None  # the parsed value → the stored one; ValueError: a usage error
    cli_type: Any = None            # what typer parses when it is not the field's type (an enum: str)
    show_default: bool = True


def option(*flags: str, help: str, default: Any = MISSING, default_factory: Any = MISSING, group: str = "model",
           check: Callable[[Any], Any] | None = None, cli_type: Any = None, show_default: bool = True) -> Any:
    """A dataclass field declared as a command-line option too."""
    meta = {"option": Option(tuple(flags), help, group, check, cli_type, show_default)}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def declared(cls) -> Iterator[tuple[str, dataclasses.Field, Option]]:
    """(name, field, Option) of every field of the dataclass `cls` declared with `option`."""
    for f in dataclasses.fields(cls):
        if "option" in f.metadata:
            yield f.name, f, f.metadata["option"]


def at_least(low: int, meaning: str = "") -> Callable[[int], int]:
    """A check: an integer >= low (`meaning` says what the lowest value does)."""
    def check(value: int) -> int:
        if value < low:
            raise ValueError(f"must be >= {low}{f' ({meaning})' if meaning else ''}, got {value}")
        return value
    return check


def one_of(enum) -> Callable[[Any], Any]:
    """A check: a member of the enum `enum`, by value, case and spaces ignored."""
    def check(value):
        try:
            return enum(str(getattr(value, "value", value)).strip().lower())
        except ValueError:
            raise ValueError(f"must be {', '.join(m.value for m in enum)}, got {value!r}") from None
    return check
