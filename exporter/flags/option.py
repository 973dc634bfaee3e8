"""How a setting is declared: its ``Option`` (flag, help, default, how its text is read), from which come its
flag, its environment variable and its row in the table of flags; and how the files settings name are read.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ENV_PREFIX = "CACHE_CONFIG_EXPORTER_"
_TRUE = ("1", "true", "yes", "on")
# The key of a settings field's ``Option`` in the field's metadata.
OPTION = "option"


def env_name(flag: str) -> str:
    """``--web.listen-address`` -> ``CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS``."""
    return ENV_PREFIX + flag.lstrip("-").replace(".", "_").replace("-", "_").upper()


class SettingsError(ValueError):
    """A setting that cannot work; the message names the flag."""


@dataclass(frozen=True)
class Option:
    """One flag, declared once: its name, help and default, how its text is read; its environment variable
    and its row in the README follow from these.

    ``parse`` turns the flag's text into the value (``None``: the text itself; for a setting, read by its type).
    ``context`` names settings whose values ``parse`` takes after the text. ``documented`` is the default as
    the README tells it, where the machine decides the value. ``formerly``: flags this one was once called,
    still read (flag and environment variable), so that a configuration written for them keeps working; a
    start that uses one is told the name to use (``former_names_used``).
    """

    flag: str
    help: str
    default: object = None
    default_factory: Callable[[], object] | None = None
    parse: Callable[..., object] | None = None
    choices: tuple[str, ...] | None = None
    switch: bool = False
    context: tuple[str, ...] = ()
    documented: str | None = None
    formerly: tuple[str, ...] = ()

    @property
    def variable(self) -> str:
        return env_name(self.flag)

    def _environment(self) -> str | None:
        """The value its environment variable gives, or failing that one of its former names' variables."""
        for flag in (self.flag, *self.formerly):
            if env_name(flag) in os.environ:
                return os.environ[env_name(flag)]
        return None

    @property
    def dest(self) -> str:
        """The attribute of argparse's namespace: the variable's name without the prefix, lower case."""
        return self.variable.removeprefix(ENV_PREFIX).lower()

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """The flag, whose default comes from its environment variable, then from the declaration."""
        if self.switch:
            enabled = (self._environment() or "").lower() in _TRUE
            parser.add_argument(
                self.flag,
                *self.formerly,
                dest=self.dest,
                action="store_true",
                default=enabled,
                help=f"{self.help} (env {self.variable})",
            )
            return
        default = self.default_factory() if self.default_factory else self.default
        environment = self._environment()
        parser.add_argument(
            self.flag,
            *self.formerly,
            dest=self.dest,
            default=default if environment is None else environment,
            type=None if self.context else self.parse,
            choices=self.choices,
            help=f"{self.help} (env {self.variable}; default: %(default)s)",
        )

    def markdown_row(self) -> str:
        formerly = "".join(f" (formerly `{flag}`, still read)" for flag in self.formerly)
        return f"| `{self.flag}` | `{self.variable}` | {self._documented_default()} | {self.help}{formerly} |"

    def former_names_used(self, argv: Sequence[str]) -> list[tuple[str, str]]:
        """Each former flag in ``argv`` (``--flag value`` or ``--flag=value``) and former environment variable
        set, with the name to use instead: each deserves a word at start-up."""
        used = [
            (flag, self.flag)
            for flag in self.formerly
            if any(arg == flag or arg.startswith(f"{flag}=") for arg in argv)
        ]
        return used + [(env_name(flag), self.variable) for flag in self.formerly if env_name(flag) in os.environ]

    def _documented_default(self) -> str:
        if self.documented is not None:
            return f"`{self.documented}`"
        if self.switch:
            return "off"
        if self.default is None:
            return "none"
        if self.default == "":
            return "empty"
        return f"`{self.default:g}`" if isinstance(self.default, float) else f"`{self.default}`"


def setting(default: object, flag: str, help_text: str, **declared: Any) -> Any:
    """A ``Settings`` field and the flag that sets it. The flag's default is the field's, unless
    ``flag_default`` says otherwise; a ``default_factory`` makes both."""
    flag_default = declared.pop("flag_default", default)
    option = Option(flag, help_text, flag_default, **declared)
    if option.default_factory is not None:
        return field(default_factory=option.default_factory, metadata={OPTION: option})
    return field(default=default, metadata={OPTION: option})


def flag_in(group: type, name: str) -> str:
    """The flag of the field ``name`` of an options group, for the messages of the part that owns the group."""
    return next(item.metadata[OPTION].flag for item in fields(group) if item.name == name)


def file_setting(flag: str, help_text: str) -> Any:
    """A setting that names a file, none by default."""
    return setting(None, flag, help_text)


def list_setting(flag: str, help_text: str) -> Any:
    """A setting that takes a comma-separated list, empty by default."""
    return setting((), flag, help_text, flag_default="", parse=entries)


def optional_path(text: str) -> Path | None:
    return Path(text) if text else None


def entries(text: str) -> tuple[str, ...]:
    """A comma-separated list, blank entries dropped."""
    return tuple(entry.strip() for entry in text.split(",") if entry.strip())


def read_file(flag: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise SettingsError(f"{flag} {path}: {error.strerror}") from None
