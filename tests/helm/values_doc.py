#!/usr/bin/env python3
"""The values table of helm/shardserve/README.md, made from values.yaml (helm-docs conventions).

A value is documented by the `# -- text` comment lines right above its key (continued by further
`#` lines). A documented key whose value is a map is one row (its default shown as JSON); an
undocumented map is a section whose keys are rows. Every row needs a description.

  python3 tests/helm/values_doc.py           print the table
  python3 tests/helm/values_doc.py --write   replace the table between the README's markers
The helm_chart_test checks that the README holds exactly this table.
"""
import json
import re
import sys
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "shardserve"
START = "<!-- values-table:start (tests/helm/values_doc.py --write) -->"
END = "<!-- values-table:end -->"
KEY = re.compile(r"^(\s*)([A-Za-z0-9_.-]+):(\s.*)?$")


def descriptions(text):
    """{dotted key path: description} from the `# --` comments of values.yaml."""
    out = {}
    stack = []  # (indent, key)
    pending = None
    block_indent = None  # inside a block scalar or a list: skip lines indented deeper than this
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if block_indent is not None:
            if stripped == "" or indent > block_indent:
                continue
            block_indent = None
        if stripped.startswith("# --"):
            pending = stripped[4:].strip()
            continue
        if stripped.startswith("#"):
            if pending is not None:
                pending += " " + stripped[1:].strip()
            continue
        if stripped == "":
            pending = None
            continue
        if stripped.startswith("- "):
            continue
        m = KEY.match(line)
        if not m:
            pending = None
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        path = ".".join(k for _, k in stack)
        if pending is not None:
            out[path] = pending
        pending = None
        rest = (m.group(3) or "").strip()
        if rest.startswith("|") or rest.startswith(">"):
            block_indent = indent
    return out


def rows(values, docs, prefix=""):
    for key, value in values.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and value and path not in docs:
            yield from rows(value, docs, path)
        else:
            yield path, value, docs.get(path)


def type_of(v):
    return {bool: "bool", int: "int", float: "float", str: "string", list: "list", dict: "object",
            type(None): "null"}[type(v)]


def default_of(v):
    if isinstance(v, str) and "\n" in v:
        return "(a script: see values.yaml)"
    return "`" + json.dumps(v).replace("|", "\\|") + "`"


def table():
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    docs = descriptions(text)
    lines = ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    missing = []
    for path, value, doc in rows(values, docs):
        if not doc:
            missing.append(path)
        description = (doc or "").replace("|", "\\|")
        lines.append(f"| `{path}` | {type_of(value)} | {default_of(value)} | {description} |")
    return "\n".join(lines) + "\n", missing


def main():
    t, missing = table()
    if missing:
        print("values.yaml: no '# --' description for: " + ", ".join(missing), file=sys.stderr)
        return 1
    if "--write" in sys.argv:
        readme = CHART / "README.md"
        text = readme.read_text()
        if START not in text or END not in text:
            print(f"{readme}: the markers {START} and {END} are missing", file=sys.stderr)
            return 1
        head, rest = text.split(START, 1)
        _, tail = rest.split(END, 1)
        readme.write_text(f"{head}{START}\n{t}{END}{tail}")
        print(f"wrote the values table into {readme}")
    else:
        sys.stdout.write(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
