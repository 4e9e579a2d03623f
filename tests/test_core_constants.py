"""Every numeric module-level constant of the ts-* cores' Python is a documented fixed constant
(docs/development.md, "Fixed constants of the cores"): the cores have no hidden knobs either."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "development.md"


def _numeric_constants() -> dict[str, str]:
    """'package.module.NAME' -> its source text, for module-level UPPER_CASE names bound to a number."""
    out = {}
    for path in sorted(ROOT.glob("packages/ts-*/src/*/**/*.py")):
        src = next(p for p in path.parents if p.name == "src")
        module = ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
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


def test_every_numeric_constant_of_the_cores_is_documented_as_fixed():
    constants = _numeric_constants()
    assert "ts_pinned._arena.DEFAULT_SLAB_BYTES" in constants and "ts_quant._packed.WINDOW" in constants  # found
    table = DOC.read_text().split("## Fixed constants of the cores")[1].split("\n## ")[0]
    documented = set(re.findall(r"^\| `([\w.]+)` \|", table, re.M))
    missing = sorted(set(constants) - documented)
    assert not missing, f"document these in docs/development.md's 'Fixed constants of the cores': {missing}"
    stale = sorted(documented - set(constants))
    assert not stale, f"docs/development.md lists core constants that no longer exist: {stale}"
