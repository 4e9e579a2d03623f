r"""A/B of two versions of trainstream's Python on one host: compare.py runs for each in turn, rounds apart.

The H200 hosts lent to this project differ by up to 40 % in step time for the same code (0.54 against
0.69-0.90 s for the 14B bf16 streamed LoRA step, 2026-12-03), and steps drift within a run. An A/B
across calls, or one run after the other, measures the host as much as the change. Here the two versions
alternate on one host (A B A B ...), each in its own process, and the table gives every run's median
and the median over each version's runs.

Only the pure-Python ``trainstream`` package is swapped: the base version's processes import it from its
source tree (``--base-dir``, or ``--base REV`` exported from git here) through a ``sitecustomize`` put
first on their ``PYTHONPATH`` (it shadows any other sitecustomize); the head is the installed one. The
native ts-* packages are the installed ones for both.

    python tools/bench/interleaved_ab.py --base HEAD~1 --scenario lora14b --engine trainstream-lora-bf16 \
        --rounds 2 --steps 12 --wrap-option param_offload=auto
    # on the device, where git may not know the revision: export it here first, carry it
    git archive HEAD~1 packages/trainstream/src | tar -x -C .whl/base
    python tools/bench/interleaved_ab.py --base-dir .whl/base/packages/trainstream/src ...
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def export_revision(rev: str, into: pathlib.Path) -> pathlib.Path:
    """trainstream's source tree at `rev` (git, here), extracted under `into`; returns the import root."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "packages/trainstream/src"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "packages" / "trainstream" / "src"


# Put first on the base version's PYTHONPATH: every process of that version (compare.py starts one per
# engine) imports trainstream from the base tree, also where an editable install's import hook would
# otherwise redirect it to the working tree.
_SITECUSTOMIZE = """
import importlib.machinery, os, sys

_BASE = os.environ["TS_AB_BASE_DIR"]


class _BaseFirst:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "trainstream":
            return importlib.machinery.PathFinder.find_spec(name, [_BASE])
        if name.startswith("trainstream.") and path and all(p.startswith(_BASE) for p in path):
            return importlib.machinery.PathFinder.find_spec(name, path)
        return None


sys.meta_path.insert(0, _BaseFirst)
"""


def _env(base_dir: pathlib.Path | None, hook_dir: pathlib.Path | None = None) -> dict:
    env = dict(os.environ)
    if base_dir is not None:
        first = [str(hook_dir)] if hook_dir is not None else []
        env["PYTHONPATH"] = os.pathsep.join(first + [str(base_dir)] + [p for p in [env.get("PYTHONPATH")] if p])
        env["TS_AB_BASE_DIR"] = str(base_dir)
    return env


def write_hook(into: pathlib.Path) -> pathlib.Path:
    hook = into / "ab-hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return hook


def imported_from(base_dir: pathlib.Path | None, hook_dir: pathlib.Path | None = None) -> str:
    """Where ``import trainstream.memory`` resolves in a run of that version (recorded beside its numbers)."""
    done = subprocess.run([sys.executable, "-c", "import trainstream.memory as m; print(m.__file__)"],
                          capture_output=True, text=True, env=_env(base_dir, hook_dir), check=True)
    return done.stdout.strip()


def run_once(version: str, base_dir: pathlib.Path | None, hook_dir, args, out: pathlib.Path) -> dict:
    cmd = [sys.executable, str(HERE / "compare.py"), "--scenario", args.scenario, "--engines", args.engine,
           "--rounds", "1", "--json", str(out), "--timeout", str(args.timeout)]
    cmd += ["--steps", str(args.steps)] if args.steps else []
    cmd += [f"--wrap-option={o}" for o in args.wrap_option]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(base_dir, hook_dir), cwd=HERE)
    row = {"version": version, "rc": done.returncode}
    if out.exists():
        (result,) = json.loads(out.read_text())["results"]
        row.update(outcome=result.get("outcome"), median_s=result.get("median_s"),
                   steps_s=result.get("steps_s"), peak_gb=result.get("peak_gb"))
    else:
        row.update(outcome=f"no result (rc {done.returncode}): {done.stderr.strip()[-400:]}")
    return row


def row_line(r: dict) -> str:
    median = f"{r['median_s']:.3f}" if r.get("median_s") else r.get("outcome", "?")[:40]
    peak = f"{r['peak_gb']:.1f}" if r.get("peak_gb") else "-"
    steps = " ".join(f"{s:.3f}" for s in r.get("steps_s") or [])
    return f"{r['round']:5d} {r['version']:>7s} {median:>9s} {peak:>8s}  {steps}"


def summary(rows: list[dict]) -> list[str]:
    lines = [f"{'round':>5s} {'version':>7s} {'median s':>9s} {'peak GB':>8s}  steps (s)"]
    lines += [row_line(r) for r in rows]
    for version in ("base", "head"):
        medians = [r["median_s"] for r in rows if r["version"] == version and r.get("median_s")]
        if medians:
            lines.append(f"{version}: median of its {len(medians)} runs' medians {statistics.median(medians):.3f} s "
                         f"(runs: {', '.join(f'{m:.3f}' for m in medians)})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--base", help="a git revision (exported here with git archive)")
    where.add_argument("--base-dir", type=pathlib.Path, help="the base version's import root (holding trainstream/)")
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--engine", required=True, help="one trainstream engine of compare.py")
    parser.add_argument("--rounds", type=int, default=2, help="each version runs this many times, alternating")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run (compare.py's)")
    parser.add_argument("--wrap-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", default=None, help="write every run's row here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        base_dir = export_revision(args.base, tmp) if args.base else args.base_dir.resolve()
        if not (base_dir / "trainstream" / "__init__.py").exists():
            parser.error(f"{base_dir} holds no trainstream package")
        hook = write_hook(tmp)
        where = {"base": imported_from(base_dir, hook), "head": imported_from(None)}
        if not where["base"].startswith(str(base_dir)):
            raise SystemExit(f"the base version imports trainstream from {where['base']}, not {base_dir}: it is not swapped in")
        print(f"base: {args.base or args.base_dir} -> {where['base']}\nhead: installed -> {where['head']}")
        rows = []
        for round_ in range(1, args.rounds + 1):
            for version in ("base", "head"):
                row = run_once(version, base_dir if version == "base" else None, hook, args,
                               tmp / f"{version}-{round_}.json")
                rows.append({"round": round_, **row})
                print(row_line(rows[-1]), flush=True)
    print("\n".join(summary(rows)))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"imported_from": where, "args": vars(args) | {
            "base_dir": str(args.base_dir) if args.base_dir else None}, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
