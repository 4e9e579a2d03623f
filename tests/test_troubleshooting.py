"""docs/troubleshooting.md lists every refusal and error message the packages raise, and nothing the code no
longer says.

A *site* is, in packages/*/src/**/*.py: ``raise Name(message)`` (or ``raise module.Name(message)``), an
exception built elsewhere (``return ValueError(message)``, ``failure = RuntimeError(message)``: a call of a
name ending in Error, Exception, Refused, Failed, Mismatch, Unavailable or Exit), or a CLI refusal
``parser.error(message)``; its message is the first argument built from string literals: a literal, an
f-string, ``+`` / ``.format`` / ``%`` of them, a module-level string constant, a local variable assigned once
to one, or either branch of ``a if c else b``. Messages built out of sight (``PlanRefused(plan.message)``,
``CliError(str(error))``) are not sites: the page lists them by hand, and the stale check below still holds
those entries to the code.

Coverage: each site's *key* must appear in the page (whitespace collapsed, backticks and Markdown escapes
dropped). The key is the message up to the end of its first constant run of at least MIN_LEAD characters, each
placeholder before it written ``…``, cut at KEY_MAX characters (so the page may shorten a very long message with
a closing ``…``). For a message with a constant lead that is its leading text up to the first placeholder.
Sites with no such run (``f"{a} lacks {b}"``) are listed in ALLOWED with the reason.

Staleness: each table row of the page whose first cell starts with a code span is an entry, the span being a
message as the user sees it with ``…`` for its variable parts. Each entry must match a string of the code: its
pieces between ``…`` appear in it in order, the first at its start.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "troubleshooting.md"
SOURCES = sorted((ROOT / "packages").glob("*/src/**/*.py"))
MIN_LEAD = 12
KEY_MAX = 160
HOLE = "…"
_EXCEPTION = re.compile(r"(Error|Exception|Refused|Failed|Mismatch|Unavailable|Exit)$")

# Sites whose message has no constant run of MIN_LEAD characters: (file, message as the test renders it) ->
# why. Each is still on the page, under the message as the user sees it; only the automatic check skips it.
ALLOWED: dict[tuple[str, str], str] = {
    ("packages/trainstream/src/trainstream/_cli_common.py", "takes …, not …"):
        "argparse's `argument --X: takes …, not …`: the option's valid range is the placeholder",
    ("packages/trainstream/src/trainstream/_cli_common.py", "must be …, not …"):
        "argparse's `argument --X: must be …, not …`: the option's valid range is the placeholder",
    ("packages/trainstream/src/trainstream/_compile.py", "mode=…: one of …"):
        "compile_blocks(mode=): the valid modes are the placeholder",
    ("packages/trainstream/src/trainstream/_config.py", "Config.… must be a …, not …"):
        "trainstream.Config(group=...): every word but the group and class names is a placeholder",
    ("packages/trainstream/src/trainstream/_optimizer.py", "… lacks …"):
        "load_state_dict: `state_dict's state for parameter N lacks ['step', ...]`, assembled from parts",
    ("packages/trainstream/src/trainstream/_optimizer.py", "…: … has … values, … has …"):
        "load_state_dict: a state tensor's size against its parameter's; only numbers and names",
    ("packages/trainstream/src/trainstream/_plan_cli.py", "--nvme-path …: …"):
        "`trainstream plan --nvme-path`: the disk probe's own OSError follows the path (listed under ts-planner)",
    ("packages/trainstream/src/trainstream/cli.py", "--model …: …"):
        "`trainstream --model`: the loader's own message follows the model name (listed under the CLI)",
    ("packages/trainstream/src/trainstream/integrations/hf_loading.py", "load_model: …"):
        "load_model: prefix to a constant (SHARDS_DISAGREE) formatted with names, listed in full",
    ("packages/ts-peer/src/ts_peer/_backend.py", "PeerPool on …: …"):
        "ts-peer: the device and the reason CUDA is unavailable are placeholders",
    ("packages/ts-planner/src/ts_planner/_budget.py", "Budget.…=… must be > 0"):
        "ts_planner.Budget: the rate field's name and value are placeholders",
    ("packages/ts-planner/src/ts_planner/_shape.py", "… is not JSON…"):
        "ModelShape.from_config: `PATH is not JSON (MSG at line N)`; the constant is 11 characters",
}


@dataclasses.dataclass(frozen=True)
class Site:
    path: str  # relative to ROOT
    line: int
    exception: str
    template: str  # the message, normalized, each placeholder shown as HOLE

    @property
    def key(self) -> str:
        """What the page must hold (module docstring); "" when the message has no constant run of MIN_LEAD."""
        out = []
        for piece in self.template.split(HOLE):
            out.append(piece)
            if len(piece.strip()) >= MIN_LEAD:
                return HOLE.join(out).strip()[:KEY_MAX].strip()
        return ""


def normalize(text: str) -> str:
    """Whitespace collapsed, backticks and Markdown backslash escapes dropped, runs of HOLE made one."""
    text = re.sub(r"\\([\\`*_{}\[\]()#+\-.!|<>])", r"\1", text).replace("`", "")
    return re.sub(HOLE + "+", HOLE, re.sub(r"\s+", " ", text)).strip()


def _format_template(fmt: str) -> str:
    """A str.format string with each replacement field as HOLE (``{{`` and ``}}`` are literal braces)."""
    out, i = [], 0
    while i < len(fmt):
        if fmt.startswith(("{{", "}}"), i):
            out.append(fmt[i])
            i += 2
        elif fmt[i] == "{":
            end = fmt.find("}", i)
            out.append(HOLE)
            i = len(fmt) if end < 0 else end + 1
        else:
            out.append(fmt[i])
            i += 1
    return "".join(out)


def _percent_template(fmt: str) -> str:
    return re.sub(r"%%|%(\([^)]*\))?[-#0 +]*\d*(\.\d+)?[a-zA-Z]", lambda m: "%" if m.group() == "%%" else HOLE, fmt)


def template(node: ast.expr, names: dict[str, ast.expr] | None = None) -> str | None:
    """The message an expression builds, each variable part as HOLE; None if it is not built from literals.
    A name in ``names`` (string constants in scope) stands for its value."""
    names = names or {}
    if isinstance(node, ast.Name) and node.id in names:
        return template(names[node.id])
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = template(node.left, names), template(node.right, names)
        if left is None:
            return None
        return left + (HOLE if right is None else right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        left = template(node.left, names)
        return None if left is None else _percent_template(left)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        fmt = node.func.value
        fmt = names.get(fmt.id, fmt) if isinstance(fmt, ast.Name) else fmt
        if isinstance(fmt, ast.Constant) and isinstance(fmt.value, str):
            return _format_template(fmt.value)
    return None


def messages(node: ast.expr, names: dict[str, ast.expr]) -> list[str]:
    """The messages an exception's argument can be: both branches of ``a if c else b``."""
    if isinstance(node, ast.IfExp):
        return messages(node.body, names) + messages(node.orelse, names)
    text = template(node, names)
    return [] if text is None else [text]


def _string_assignments(body: list[ast.stmt] | ast.AST, once: bool) -> dict[str, ast.expr]:
    """NAME = <string> in ``body`` (statements) or anywhere inside a function; with ``once``, only names assigned
    exactly once there and never augmented."""
    nodes = body if isinstance(body, list) else list(ast.walk(body))
    counts: dict[str, int] = {}
    found: dict[str, ast.expr] = {}
    for node in nodes:
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            if isinstance(target, ast.Name):
                counts[target.id] = counts.get(target.id, 0) + 1
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and template(node.value) is not None:
                    found[target.id] = node.value
    return {k: v for k, v in found.items() if not once or counts[k] == 1}


def _parse(sources: list[pathlib.Path]) -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p), ast.parse(p.read_text(), str(p)))
            for p in sources]


def _call_name(call: ast.Call, raised: bool) -> str | None:
    """The exception (or "parser.error") a call builds, None for any other call."""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr == "error" and isinstance(func.value, ast.Name) \
            and func.value.id == "parser":
        return "parser.error"
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    return name if name is not None and (raised or _EXCEPTION.search(name)) else None


def sites(sources: list[pathlib.Path] = SOURCES) -> list[Site]:
    parsed = _parse(sources)
    constants: dict[str, ast.expr] = {}
    for _, tree in parsed:
        constants.update(_string_assignments(tree.body, once=False))
    found = set()
    for rel, tree in parsed:
        scopes = [(tree, {})] + [(f, _string_assignments(f, once=True)) for f in ast.walk(tree)
                                 if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        own = _string_assignments(tree.body, once=False)  # this module's constants win over an imported name's
        for scope, local in scopes:
            names = {**constants, **own, **local}
            raised = {id(n.exc) for n in ast.walk(scope) if isinstance(n, ast.Raise)}
            for node in ast.walk(scope):
                if not isinstance(node, ast.Call):
                    continue
                name = _call_name(node, id(node) in raised)
                texts = next((m for m in (messages(a, names) for a in node.args) if m), []) if name else []
                found.update(Site(rel, node.lineno, name, normalize(text)) for text in texts)
    # A call inside a function is read from the module and from each function around it (with their locals):
    # the readings agree but for a local name, which only the function's reading resolves.
    return sorted(found, key=lambda s: (s.path, s.line, s.template))


def source_strings(sources: list[pathlib.Path] = SOURCES) -> set[str]:
    """Every string the source builds from literals: the sites' messages, the messages assembled elsewhere (a
    refusal's text built by a function, then raised) and their parts."""
    parsed = _parse(sources)
    constants: dict[str, ast.expr] = {}
    for _, tree in parsed:
        constants.update(_string_assignments(tree.body, once=False))
    out = {s.template for s in sites(sources)}
    for _, tree in parsed:
        for node in ast.walk(tree):
            if isinstance(node, ast.expr):
                text = template(node, constants)
                if text:
                    out.add(normalize(text))
    return out


_ROW = re.compile(r"^\|(.*)\|[ \t]*$", re.M)
_SPAN = re.compile(r"(`+)(.+?)\1")


def entries(page: pathlib.Path = PAGE) -> list[tuple[int, str]]:
    """(line, message) of each table row whose first cell starts with a code span."""
    out = []
    text = page.read_text()
    for match in _ROW.finditer(text):
        first = re.split(r"(?<!\\)\|", match.group(1))[0].strip()
        span = _SPAN.match(first)
        if span:
            out.append((text.count("\n", 0, match.start()) + 1, normalize(span.group(2))))
    return out


def matches(entry: str, string: str) -> bool:
    """Whether ``string`` (a message with HOLEs) reads as ``entry``: its pieces in order, the first at the start."""
    pieces = [p.strip() for p in entry.split(HOLE)]
    if not string.startswith(pieces[0]):
        return False
    at = len(pieces[0])
    for piece in pieces[1:]:
        at = string.find(piece, at)
        if at < 0:
            return False
        at += len(piece)
    return True


def missing(found: list[Site], page_text: str) -> list[str]:
    out = []
    for site in found:
        if not site.key:
            if (site.path, site.template) not in ALLOWED:
                out.append(f"{site.path}:{site.line}: {site.exception}({site.template!r}) has no constant run of "
                           f"{MIN_LEAD} characters: list it on the page and in ALLOWED (tests/test_troubleshooting.py)"
                           f" with the reason")
        elif site.key not in page_text:
            out.append(f"{site.path}:{site.line}: {site.exception}: add to docs/troubleshooting.md a row whose "
                       f"message is `{site.template}` (… marks a placeholder), with what it means and the fix")
    return out


def stale(rows: list[tuple[int, str]], strings: set[str]) -> list[str]:
    return [f"docs/troubleshooting.md:{line}: `{entry}` is said by no code: update or remove the entry"
            for line, entry in rows if not any(matches(entry, s) for s in strings)]


def test_every_message_has_an_entry():
    problems = missing(sites(), normalize(PAGE.read_text()))
    assert not problems, f"{len(problems)} messages are not on the page:\n" + "\n".join(problems)


def test_no_entry_is_stale():
    problems = stale(entries(), source_strings())
    assert not problems, f"{len(problems)} stale entries:\n" + "\n".join(problems)


def test_the_allow_list_is_current():
    found = {(s.path, s.template) for s in sites() if not s.key}
    gone = [key for key in ALLOWED if key not in found]
    assert not gone, f"ALLOWED lists sites the code no longer has (or that gained a constant lead): {gone}"


def test_the_extraction_sees_the_known_shapes():
    found = sites()
    by = {(s.path.rsplit("/", 1)[-1], s.exception) for s in found}
    assert len(found) > 450 and len(entries()) > 400
    assert ("autotune.py", "BatchRefused") in by and ("decide.py", "PlanRefused") in by  # raise Name(f"...")
    assert ("_plan_cli.py", "parser.error") in by  # the CLI's argparse refusals
    assert ("_sizes.py", "ValueError") in by  # return ValueError(...), raised by the caller
    assert any(s.exception == "DistributedError" and "steps do not match" in s.template for s in found)  # a local
    assert any("TrainStreamCache supports greedy" in s.template and s.path.endswith("kvcache.py") for s in found)
    assert any(s.template == "PeerPool: the pool is closed" for s in found)  # a branch of `a if c else b`


def test_a_new_message_and_a_removed_entry_are_caught(tmp_path):
    source = tmp_path / "fake.py"
    source.write_text('def f(x):\n    raise ValueError(f"frobnicate={x!r} needs a widget; pass widget=True")\n')
    fake = sites([source])
    assert [s.key for s in fake] == ["frobnicate=… needs a widget; pass widget=True"]
    assert missing(fake, normalize(PAGE.read_text())) and "fake.py:2" in missing(fake, "")[0]
    page = tmp_path / "page.md"
    page.write_text("| Message | Meaning | Fix |\n|---|---|---|\n"
                    "| `frobnicate=… needs a widget; pass widget=True` | a | b |\n")
    assert not missing(fake, normalize(page.read_text()))
    assert entries(page) == [(3, "frobnicate=… needs a widget; pass widget=True")]
    assert stale(entries(page), {s.template for s in fake}) == []
    assert stale(entries(page), {"frobnicate=… needs a gadget; pass gadget=True"})  # the code's text changed
