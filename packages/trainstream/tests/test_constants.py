"""Every numeric module-level constant of trainstream is a documented fixed constant (docs/development.md,
"Fixed constants") or the default of a trainstream.Config field: no hidden knobs."""

from __future__ import annotations

import ast
import pathlib
import re

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "trainstream"
DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "development.md"


def _numeric_constants() -> dict[str, str]:
    """'module.NAME' -> its source text, for module-level UPPER_CASE names bound to a number."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            targets = [t for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
            value = getattr(node, "value", None)
            if value is None:
                continue
            try:
                number = ast.literal_eval(value) if not isinstance(value, ast.BinOp) else eval(
                    compile(ast.Expression(value), "<constant>", "eval"), {})
            except (ValueError, TypeError, SyntaxError, NameError):
                continue
            for target in targets:
                if target.id.lstrip("_").isupper() and isinstance(number, (int, float)) and not isinstance(number, bool):
                    out[f"{module}.{target.id}"] = ast.unparse(value)
    return out


def test_every_numeric_constant_is_documented_as_fixed():
    constants = _numeric_constants()
    assert "engine.updates.BATCH_MAX_VALUES" in constants and "memory.sizing._RUNTIME" in constants  # it finds them
    table = DOC.read_text().split("## Fixed constants")[1].split("\n## ")[0]
    documented = set(re.findall(r"^\| `([\w.]+)` \|", table, re.M))
    missing = sorted(set(constants) - documented)
    assert not missing, f"document these in docs/development.md's 'Fixed constants' (or make them options): {missing}"
    stale = sorted(documented - set(constants))
    assert not stale, f"docs/development.md lists constants that no longer exist: {stale}"
