"""argv <-> RunConfig: one vocabulary of flag names, generated from the config dataclasses.

One flag per config field (`--micro-batch-size`, `--tp`, `--save-interval`), its help, metavar, range and
Megatron-LM alias read from the field's metadata (`threed.config.meta`), so the command line cannot drift from the
config. `threed train`, `python -m threed.train`, `threed check-config` and `threed profile-layers` take every
field (`add_run_flags`); `threed memory` and `threed plan` take the fields they model under the same names
(`add_field_flag`), with their old short names (`--micro`, `--seq`, ...) kept as aliases.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import typing
from typing import Any, Optional, Sequence

from threed.config import SECTIONS, RunConfig, field_meta, flag_name
from threed.convert.resolve import model_config

_METAVARS = {int: "N", float: "X", str: "STR"}


def _bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {v!r}")


def _field_type(cls: type, f: dataclasses.Field) -> tuple[Any, Optional[list[str]], bool]:
    """(argparse type, choices, takes several values) of a config field."""
    hint = typing.get_type_hints(cls)[f.name]
    if typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is typing.Literal:
        return str, [str(a) for a in typing.get_args(hint)], False
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], None, True
    return {bool: _bool, int: int, float: float, str: str}[hint], None, False


MODEL_HELP = "preset (llama3.1-8b, tiny, ...), an HF config.json / dir, or a checkpoint dir"


def add_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="NAME|DIR", help=MODEL_HELP)


def config_field(section: str, name: str) -> dataclasses.Field:
    """The dataclass field behind `section.name` (KeyError names an unknown one)."""
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
    return fields[name]


def add_field_flag(
    p: Any,
    section: str,
    name: str,
    *,
    default: Any = dataclasses.MISSING,
    required: bool = False,
    old: Sequence[str] = (),
    help: Optional[str] = None,
) -> None:
    """The flag of config field `section.name` (dest `section.name`): its name, Megatron alias, type, choices and
    help from the field. `default` / `required` / `help` override the field's for commands that use the field
    differently (a planner filter has no default); `old` adds earlier names as aliases."""
    cls, f = SECTIONS[section], config_field(section, name)
    m = field_meta(f)
    if default is dataclasses.MISSING:
        default = f.default if f.default is not dataclasses.MISSING else None
    kind, choices, several = _field_type(cls, f)
    shown = " ".join(default) if isinstance(default, tuple) else default
    names = [flag_name(f), *m.aliases, *old]
    metavar = m.metavar or (
        "{true,false}" if kind is _bool else "{" + ",".join(choices) + "}" if choices else _METAVARS.get(kind, "VALUE")
    )
    # A bare boolean flag means true (Megatron-LM's store_true flags: `--sequence-parallel`, `--eod-mask-loss`);
    # `--flag false` turns a default-on one off.
    extra: dict[str, Any] = {"nargs": "?", "const": True} if kind is _bool else {"nargs": "+" if several else None}
    text = help if help is not None else m.help
    p.add_argument(
        *names,
        dest=f"{section}.{f.name}",
        type=kind,
        default=default,
        choices=choices,
        metavar=metavar,
        required=required,
        **extra,
        help=text or None if required else f"{text} (default: {shown})" if text else f"(default: {shown})",
    )


def field_value_error(section: str, name: str, text: str) -> Optional[str]:
    """Why `text` is no value of the flag of config field `section.name` (its type and choices, as argparse reads
    it), or None when it is one. For callers that name the value otherwise (a launcher's variable)."""
    kind, choices, several = _field_type(SECTIONS[section], config_field(section, name))
    words = text.split() if several else [text]
    for word in words:
        if choices is not None and word not in choices:
            return f"is not one of {', '.join(choices)}"
        try:
            kind(word)
        except (ValueError, argparse.ArgumentTypeError):
            what = {int: "a whole number", float: "a number", _bool: "true or false"}.get(kind, "a value")
            return f"is not {what}"
    return None


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """`--model` and one flag per field of every RunConfig section (dest `section.field`)."""
    add_model_flag(p)
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(section)
        for f in dataclasses.fields(cls):
            add_field_flag(group, section, f.name)


def add_command(
    sub: argparse._SubParsersAction, name: str, help: str, description: Optional[str], add_arguments, run
) -> argparse.ArgumentParser:
    """A `threed NAME` sub-command whose flags come from `add_arguments` and which `run(ns)` carries out."""
    p = sub.add_parser(
        name,
        help=help,
        description=description,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(run=run)
    return p


def standalone(prog: str, description: Optional[str], add_arguments) -> argparse.ArgumentParser:
    """The same flags as a parser of its own (`python -m threed.memory`, a command's `main`)."""
    p = argparse.ArgumentParser(
        prog=prog, description=description, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return p


def field_value(ns: argparse.Namespace, section: str, name: str) -> Any:
    return getattr(ns, f"{section}.{name}")


# A value that starts with "-" and then a digit or a dot: argparse takes `--split -5,105,0` or `--lr -1e-4` for a
# flag and says "expected one argument" (it only knows plain negative numbers like -5 or -0.1 as values).
_DASH_VALUE = re.compile(r"^-[\d.]")


def dash_values(argv: Sequence[str]) -> list[str]:
    """`--flag -5,105,0` -> `--flag=-5,105,0`, so a negative or malformed value reaches its flag's own check (one
    line naming the flag and the range) instead of argparse's usage dump. Only long flags without `=` are joined."""
    out: list[str] = []
    for a in argv:
        if out and _DASH_VALUE.match(a) and out[-1].startswith("--") and "=" not in out[-1] and out[-1] != "--":
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def did_you_mean(word: str, options: Sequence[str]) -> Optional[str]:
    """The flag of `options` an unknown `word` most likely meant: the same name under the other command's spelling
    (training's `--harness-include-path` is eval-harness's `--include-path`, and back), else the closest name."""
    flag = word.split("=", 1)[0]
    if not flag.startswith("--"):
        return None
    plain = flag[len("--harness-") :] if flag.startswith("--harness-") else None
    for spelling in (f"--harness-{flag[2:]}", f"--{plain}" if plain else None):
        if spelling in options:
            return spelling
    close = difflib.get_close_matches(flag, [o for o in options if o.startswith("--")], n=1, cutoff=0.75)
    return close[0] if close else None


def unknown_flags_line(prog: str, unknown: Sequence[str], options: Sequence[str]) -> str:
    """argparse's "unrecognized arguments" as one line with the flag each unknown one most likely meant."""
    near = [(w.split("=", 1)[0], did_you_mean(w, options)) for w in unknown]
    several = sum(w.startswith("--") for w in unknown) > 1
    hints = [f"{meant} (for {flag})" if several else meant for flag, meant in near if meant]
    said = f"; did you mean {', '.join(hints)}?" if hints else ""
    return f"{prog}: error: unrecognized arguments: {' '.join(unknown)}{said} (`{prog} --help` lists its flags)"


def run_config_from_args(ns: argparse.Namespace) -> RunConfig:
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for key, value in vars(ns).items():
        if "." in key:
            section, name = key.split(".", 1)
            values[section][name] = tuple(value) if isinstance(value, list) else value
    return RunConfig(model=model_config(ns.model), **{s: SECTIONS[s](**v) for s, v in values.items()})


def parse_run_config(argv: Sequence[str]) -> RunConfig:
    # No abbreviations: Megatron's flags share prefixes (--data-path, --data-cache-path) and a guessed one would
    # silently mean something else.
    p = argparse.ArgumentParser(prog="threed train", description="3D-parallel Llama training", allow_abbrev=False)
    add_run_flags(p)
    return run_config_from_args(p.parse_args(dash_values(argv)))
