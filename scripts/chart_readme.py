"""Writes the chart's README.md from values.yaml: every value, its default and the comment above it.

    python scripts/chart_readme.py           # rewrite charts/flashmodel-operator/README.md
    python scripts/chart_readme.py --check   # exit 1 when the README is not what values.yaml gives

values.yaml documents each value on the comment lines directly above it (STYLE.md, "The chart");
this turns that into the table users read on a chart index, so the two never drift.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "charts" / "flashmodel-operator"
KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?P<rest>.*)$")

HEADER = """\
# flashmodel-operator

{description}

```bash
helm install flashmodel charts/flashmodel-operator -n flashmodel-system --create-namespace
```

The project's README says what the operator does and how to try it; docs/design.md how it works.
Every value below is checked by `values.schema.json`: an unknown key or a value of the wrong form
fails the install. This page is generated from `values.yaml` by `scripts/chart_readme.py`.

## Values

| key | default | description |
|---|---|---|
"""


@dataclass(frozen=True)
class Value:
    """One documented key of values.yaml."""

    path: str
    default: Any
    description: str


def documented_values(text: str) -> list[Value]:
    """Each key with the comment lines directly above it, in file order; nested keys as dotted paths."""
    data = yaml.safe_load(text)
    out: list[Value] = []
    comment: list[str] = []
    parents: list[tuple[int, str]] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        match = KEY.match(line)
        if not match or not comment:
            comment = [] if not stripped else comment
            if match:
                parents = _nest(parents, len(match["indent"]), match["key"])
            continue
        parents = _nest(parents, len(match["indent"]), match["key"])
        path = ".".join(k for _, k in parents)
        out.append(Value(path, _lookup(data, [k for _, k in parents]), " ".join(comment)))
        comment = []
    return out


def _nest(parents: list[tuple[int, str]], indent: int, key: str) -> list[tuple[int, str]]:
    return [p for p in parents if p[0] < indent] + [(indent, key)]


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _lookup(data: Any, keys: list[str]) -> Any:
    for k in keys:
        data = data[k]
    return data


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _cell(value: Any) -> str:
    return "`" + _escape(json.dumps(value, separators=(", ", ": "))) + "`"


def render() -> str:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    description = " ".join(chart["description"].split())
    values = documented_values((CHART / "values.yaml").read_text())
    # A section's keys have rows of their own, so the section's row shows no default.
    sections = {p for v in values for p in _prefixes(v.path)}
    rows = [
        f"| `{v.path}` | {'' if v.path in sections else _cell(v.default)} | {_escape(v.description)} |" for v in values
    ]
    return HEADER.format(description=description) + "\n".join(rows) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the README is out of date")
    args = parser.parse_args()
    readme = CHART / "README.md"
    wanted = render()
    if args.check:
        if readme.read_text() != wanted:
            print(f"{readme} is out of date: run python scripts/chart_readme.py", file=sys.stderr)
            return 1
        return 0
    readme.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
