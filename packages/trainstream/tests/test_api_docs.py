"""docs/api.md lists every public name with its signature: checked here against the code.

Each public module's ``__all__`` must have a row, every row must name something that exists, and
the signature cell must be what ``inspect.signature`` gives (annotations left out). Rows for members
(``Class.member``) are checked the same way; instance attributes against a live object.

Regenerate the signature cells (descriptions are kept; new names get their docstring's first line):
``python packages/trainstream/tests/test_api_docs.py --write``.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import sys

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "api.md"
# Every package whose public names docs/api.md lists.
MODULES = ("trainstream", "trainstream.prototype", "trainstream.integrations.huggingface", "trainstream.integrations.trl", "ts_pinned", "ts_adamw",
           "ts_quant", "ts_planner", "ts_kvcache", "ts_peer")
# Members the reference documents by name: their rows must exist.
REQUIRED_MEMBERS = {
    "trainstream": ("TrainStreamSession.adapting", "TrainStreamSession.events", "TrainStreamSession.config",
                    "TrainStreamSession.steps", "TrainStreamSession.peer", "HardwareProfile.summary",
                    "OffloadAdamW.attach", "OffloadAdamW.synchronize", "OffloadAdamW.state_dict",
                    "OffloadAdamW.load_state_dict", "OffloadAdamW.add_param_group", "OffloadAdamW.stats",
                    "OffloadAdamW.attached"),
}
HEADER = "| Package | Name | Signature | What it does |"
_ROW = re.compile(r"^\|(.*)\|\s*$")


def _split(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", _ROW.match(line).group(1))
    return [c.strip().replace("\\|", "|") for c in cells]


def _code(cell: str) -> str:
    return cell[1:-1] if cell.startswith("`") and cell.endswith("`") else cell


def read_rows(text: str) -> list[tuple[str, str, str, str]]:
    lines = text.splitlines()
    start = lines.index(HEADER)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        package, name, signature, what = _split(line)
        rows.append((_code(package), _code(name), _code(signature), what))
    return rows


def _parameters(sig: inspect.Signature) -> str:
    parts, star_done, slash = [], False, False
    for p in sig.parameters.values():
        if p.name.startswith("_"):
            continue  # internal keyword arguments are not API
        if p.kind is p.POSITIONAL_ONLY:
            slash = True
        elif slash:
            parts.append("/")
            slash = False
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
            parts.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            parts.append(f"{p.name}={_default(p.default)}")
    if slash:
        parts.append("/")
    return ", ".join(parts)


def _default(value) -> str:
    if isinstance(value, type):
        return value.__name__
    text = repr(value)
    return text if len(text) <= 40 else type(value).__name__


def _resolve(package: str, name: str):
    obj = importlib.import_module(package)
    owner = None
    for part in name.split("."):
        owner = obj
        if not hasattr(obj, part):
            return owner, _MISSING
        obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
    return owner, obj


_MISSING = object()


def signature_of(package: str, name: str) -> str:
    """What the Signature cell must say for ``package.name``."""
    owner, obj = _resolve(package, name)
    if obj is _MISSING:
        return "(missing)"
    short = name.split(".")[-1]
    if isinstance(obj, property):
        return f"{short} (property)"
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if callable(obj):
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            return f"{short}(...)"  # a native function or class: its docstring says the arguments
        if inspect.isclass(owner) and not isinstance(inspect.getattr_static(owner, short), staticmethod):
            params = list(sig.parameters.values())
            if params and params[0].name in ("self", "cls"):
                sig = sig.replace(parameters=params[1:])
        return f"{short}({_parameters(sig)})"
    if inspect.isclass(owner):
        return f"{short} (attribute)"
    return f"{short}: {type(obj).__name__}"


def _first_line(package: str, name: str) -> str:
    _, obj = _resolve(package, name)
    doc = inspect.getdoc(obj) if obj is not _MISSING else None
    text = (doc or "").strip().split("\n\n")[0].replace("\n", " ").replace("``", "`").replace("|", "\\|")
    sentence = re.split(r"(?<=[.;])\s", text, maxsplit=1)[0]
    return sentence.rstrip(";").rstrip(".") + "." if sentence else "(to describe)"


def expected_names() -> set[tuple[str, str]]:
    names = set()
    for module in MODULES:
        names.update((module, n) for n in importlib.import_module(module).__all__)
    for module, members in REQUIRED_MEMBERS.items():
        names.update((module, m) for m in members)
    return names


def _session_attributes() -> set[str]:
    """Instance attributes of a live session (they are set in __init__, not on the class)."""
    import torch
    import trainstream

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model, _ = trainstream.wrap(model, lr=1e-3)
    try:
        return set(vars(model._trainstream_session))
    finally:
        trainstream.unwrap(model)


def test_docs_api_lists_every_public_name_with_its_signature():
    rows = read_rows(DOC.read_text())
    listed = [(package, name) for package, name, _, _ in rows]
    assert len(listed) == len(set(listed)), "a name is listed twice in docs/api.md"
    missing = sorted(expected_names() - set(listed))
    assert not missing, f"docs/api.md lacks rows for {missing}; run this file with --write"
    session_attributes = None
    for package, name, signature, what in rows:
        assert what, f"{package}.{name} has no description in docs/api.md"
        expected = signature_of(package, name)
        if expected == f"{name.split('.')[-1]} (attribute)" or expected == "(missing)":
            # Instance attributes: looked up on a live object.
            assert name.startswith("TrainStreamSession."), f"{package}.{name} does not exist"
            if session_attributes is None:
                session_attributes = _session_attributes()
            attribute = name.split(".")[-1]
            assert attribute in session_attributes, f"{package}.{name} does not exist"
            expected = f"{attribute} (attribute)"
        assert signature == expected, f"docs/api.md says {signature!r} for {package}.{name}; the code: {expected!r}"
    extra = sorted((p, n) for p, n in listed if "." not in n and (p, n) not in expected_names())
    assert not extra, f"docs/api.md lists names that are not in their module's __all__: {extra}"


def write() -> None:
    """Rewrites the table: signatures from the code, descriptions kept, new names added."""
    text = DOC.read_text()
    rows = read_rows(text)
    known = {(p, n): w for p, n, _, w in rows}
    order = [(p, n) for p, n, _, _ in rows if (p, n) in expected_names() or "." in n]
    order += sorted(expected_names() - set(order), key=lambda r: (MODULES.index(r[0]), r[1]))
    lines = [HEADER, "|---|---|---|---|"]
    for package, name in order:
        signature = signature_of(package, name)
        if signature == "(missing)" and name.startswith("TrainStreamSession."):
            signature = f"{name.split('.')[-1]} (attribute)"
        what = known.get((package, name)) or _first_line(package, name)
        lines.append(f"| `{package}` | `{name}` | `{signature.replace('|', chr(92) + '|')}` | {what} |")
    all_lines = text.splitlines()
    start = all_lines.index(HEADER)
    end = start + 2 + len(rows)
    DOC.write_text("\n".join(all_lines[:start] + lines + all_lines[end:]) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print(__doc__)
