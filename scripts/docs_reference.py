"""The docs site's generated references, and the mkdocs hook that writes them into their pages.

- the configuration reference: every field of `ftjax.config.Config`, from the pydantic model (its
  type, default, constraints and `description=`), so it cannot drift from what `ftjax train` accepts;
- the command-line reference: every `ftjax` subcommand (and `ftjax bench NAME`, `ftjax data
  prepare`) with every flag, from the argparse parsers the commands themselves build.

mkdocs.yml names this file under `hooks:`; a page that holds `<!-- ftjax:config-reference -->` or
`<!-- ftjax:cli-reference -->` gets the table in its place. tests/unit/test_docs.py uses the same
functions to require a description on every field and a help text on every flag.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass

CONFIG_MARK = "<!-- ftjax:config-reference -->"
CLI_MARK = "<!-- ftjax:cli-reference -->"


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Field:
    name: str  # dotted: `model.d_model`
    type: str
    default: str
    constraints: str
    description: str
    section: bool  # a nested section (`model`), whose own fields follow


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return ", ".join(repr(a) for a in typing.get_args(annotation))  # (no "|": the table's separator)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(info) -> str:
    out = []
    for item in info.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "length >=")):
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{sign} {value}")
    return ", ".join(out)


def config_fields(model=None, prefix: str = "") -> list[Field]:
    """Every field of the config, depth first, sections before their fields."""
    from pydantic import BaseModel

    if model is None:
        from ftjax.config import Config

        model = Config
    fields = []
    for name, info in model.model_fields.items():
        dotted = prefix + name
        nested = isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
        if nested:
            default = ""
        elif info.default_factory is not None:
            default = repr(info.default_factory())
        else:
            default = repr(info.default)
        fields.append(
            Field(
                dotted,
                "section" if nested else _type_name(info.annotation),
                default,
                _constraints(info),
                " ".join((info.description or "").split()),
                nested,
            )
        )
        if nested:
            fields += config_fields(info.annotation, dotted + ".")
    return fields


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_markdown() -> str:
    lines = []
    for f in config_fields():
        if f.section:
            lines += [
                "",
                f"### `{f.name}`",
                "",
                f.description,
                "",
                "| field | type | default | constraints | what it does |",
            ]
            lines += ["|---|---|---|---|---|"]
            continue
        if "." not in f.name and not lines:
            lines += [
                "### top level",
                "",
                "| field | type | default | constraints | what it does |",
                "|---|---|---|---|---|",
            ]
        cells = (
            f"`{f.name}`",
            f"`{_cell(f.type)}`",
            f"`{_cell(f.default)}`",
            _cell(f.constraints),
            _cell(f.description),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- command line


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


@contextlib.contextmanager
def _capturing() -> Iterator[None]:
    """While inside, the first parse of any ArgumentParser raises _Captured with the parser: a
    command's main() builds its parser and hands it over before it does anything."""
    names = ("parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args")
    saved = {n: getattr(argparse.ArgumentParser, n) for n in names}

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    try:
        for n in names:
            setattr(argparse.ArgumentParser, n, capture)
        yield
    finally:
        for n, f in saved.items():
            setattr(argparse.ArgumentParser, n, f)


def _parser_of(target: str, argv: list[str]) -> argparse.ArgumentParser:
    from ftjax.cli.main import resolve

    main = resolve(target)
    with _capturing(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except _Captured as c:
            return c.parser
    raise RuntimeError(f"{target}({argv}) returned without building a parser")


def cli_parsers() -> dict[str, argparse.ArgumentParser]:
    """`ftjax COMMAND` (and `ftjax bench NAME`, `ftjax data prepare`) -> the parser it builds."""
    from ftjax.cli.bench import BENCHES
    from ftjax.cli.main import COMMANDS

    out = {}
    for name, (target, _) in COMMANDS.items():
        if name == "bench":
            for bench in BENCHES:
                out[f"bench {bench}"] = _parser_of(target, [bench])
        elif name == "data":
            out["data prepare"] = _parser_of(target, ["prepare"])
        else:
            out.update(_with_subcommands(name, _parser_of(target, [])))
    return out


def _with_subcommands(name: str, parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser, or each of its argparse subcommands' (`ftjax convert hf`, `ftjax convert to-hf`)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return {name: parser}
    return {f"{name} {sub}": p for action in subs for sub, p in action.choices.items()}


def cli_flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's arguments, without argparse's own --help."""
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def _flag_names(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.nargs != 0:
            names += f" `{action.metavar or action.dest.upper()}`"
        return names
    return f"`{action.metavar or action.dest}`"


def cli_markdown() -> str:
    from ftjax.cli.main import COMMANDS

    lines = ["| command | what it does |", "|---|---|"]
    parsers = cli_parsers()
    for n, (_, h) in COMMANDS.items():
        first = next(name for name in parsers if name == n or name.startswith(n + " "))
        lines.append(f"| [`ftjax {n}`](#ftjax-{first.replace(' ', '-')}) | {_cell(h)} |")
    for name, parser in parsers.items():
        lines += ["", f"### `ftjax {name}`", ""]
        if parser.description:
            lines += [" ".join(parser.description.split()), ""]
        lines += [
            f"```\n{parser.format_usage().strip()}\n```",
            "",
            "| argument | default | what it does |",
            "|---|---|---|",
        ]
        for a in cli_flags(parser):
            default = "" if a.default in (None, argparse.SUPPRESS, False) or a.nargs == 0 else f"`{a.default!r}`"
            lines.append(f"| {_flag_names(a)} | {_cell(default)} | {_cell(' '.join((a.help or '').split()))} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the mkdocs hook


def on_page_markdown(markdown: str, page, config, files) -> str:
    if CONFIG_MARK in markdown:
        markdown = markdown.replace(CONFIG_MARK, config_markdown())
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_markdown())
    return markdown
