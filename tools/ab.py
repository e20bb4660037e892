"""Compare two or more checkouts of kvd on this machine, alternated: old, new, old, new.

Run: ``python tools/ab.py --tree old=.probe/old --tree new=. [--rounds 2]
[--timeline NAME:ARGS]... [--bench] [--connector] [--out DIR]``

Runs on the GPU host differ by ±15 % from one to the next, and more from one machine of
the kind to the next, so a change is judged only against the code before it, measured in
the same sitting, alternated (docs/architecture.md, *Measuring a change*). Each tree is a
checkout (``git archive REF | tar -x -C .probe/NAME``); every case runs with that tree
first on ``PYTHONPATH``, followed by whatever ``PYTHONPATH`` holds already (the wheels'
directory on the device machine, see ``.ci/gpu``). Cases:

- ``--timeline c:--device cuda --blocks 1 --block-bytes 1048576 --contiguous --repeat 300``
  runs ``tools/timeline.py`` with those arguments and takes its median (µs);
- ``--bench`` runs ``benchmarks/gpu_transfer.py`` and takes (a), (b), (d) kvd/raw and
  (c) µs (medians);
- ``--connector`` runs ``benchmarks/connector_transfer.py --device cuda`` and takes the
  pull, push and concurrent pull (``pull_xN``, where the tree has it) kvd/raw (medians).

Prints, per case and figure, each tree's values in run order and their median; with
``--out``, every run's whole output goes to ``DIR/ab.log`` and the figures to
``DIR/ab.json`` (two files: the device machine brings back at most eight).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any


def last_json(text: str) -> dict[str, Any]:
    """The JSON object a benchmark or timeline prints as its last line."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            found: dict[str, Any] = json.loads(line)
            return found
    raise ValueError("no JSON line in the output")


def figures(kind: str, result: dict[str, Any]) -> dict[str, float]:
    if kind == "timeline":
        return {"us": result["total_median_us"]}
    if kind == "bench":
        return {"a": result["a_ratio_median"], "b": result["b_ratio_median"],
                "d": result["d_ratio_median"], "c_us": result["c_kvd_median_us"]}
    found = {"pull": result["pull"]["ratio_median"], "push": result["push"]["ratio_median"]}
    if "pull_early" in result:  # (a flow added later than the others)
        found["early"] = result["pull_early"]["ratio_median"]
    many = f"pull_x{result.get('concurrent', 0)}"  # absent before the concurrent flow
    if many in result:
        found[many] = result[many]["ratio_median"]
    return found


def command(kind: str, args: str) -> list[str]:
    script = {"timeline": "tools/timeline.py", "bench": "benchmarks/gpu_transfer.py",
              "connector": "benchmarks/connector_transfer.py"}[kind]
    extra = shlex.split(args) + (["--device", "cuda"] if kind == "connector" else [])
    return [sys.executable, script, *extra, "--json"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                    help="a checkout to measure (two or more)")
    ap.add_argument("--rounds", type=int, default=2, help="how many times each tree runs")
    ap.add_argument("--timeline", action="append", default=[], metavar="NAME:ARGS",
                    help="a tools/timeline.py case: a name, a colon, its arguments")
    ap.add_argument("--bench", action="store_true", help="benchmarks/gpu_transfer.py")
    ap.add_argument("--connector", action="store_true",
                    help="benchmarks/connector_transfer.py --device cuda")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--out", help="a directory for ab.log and ab.json")
    args = ap.parse_args()
    trees = []
    for spec in args.tree:
        name, sep, path = spec.partition("=")
        if not sep or not os.path.isfile(os.path.join(path, "kvd", "__init__.py")):
            ap.error(f"--tree {spec!r}: want NAME=PATH of a kvd checkout")
        trees.append((name, os.path.abspath(path)))
    if len(trees) < 2:
        ap.error("give two trees or more")
    cases = []
    for spec in args.timeline:
        name, sep, rest = spec.partition(":")
        if not sep:
            ap.error(f"--timeline {spec!r}: want NAME:ARGS")
        cases.append((name, "timeline", rest))
    if args.bench:
        cases.append(("bench", "bench", ""))
    if args.connector:
        cases.append(("connector", "connector", ""))
    if not cases:
        ap.error("nothing to run: give --timeline, --bench or --connector")
    log = open(os.path.join(args.out, "ab.log"), "w") if args.out else None  # noqa: SIM115
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    failed = 0
    for case, kind, case_args in cases:
        for round_no in range(args.rounds):
            for tree, path in trees:
                env = dict(os.environ)
                env["PYTHONPATH"] = os.pathsep.join(
                    p for p in (path, os.environ.get("PYTHONPATH", "")) if p)
                cmd = command(kind, case_args)
                started = time.monotonic()
                try:
                    run = subprocess.run(cmd, cwd=path, env=env, capture_output=True,
                                         text=True, timeout=args.timeout)
                    output, rc = run.stdout + run.stderr, run.returncode
                except subprocess.TimeoutExpired as exc:  # (text=True: str or None)
                    partial = [p.decode(errors="replace") if isinstance(p, bytes) else p
                               for p in (exc.stdout, exc.stderr) if p]
                    output, rc = "".join(partial) + "\ntimed out", -1
                took = time.monotonic() - started
                head = f"== {case} {tree} round {round_no + 1}: rc {rc}, {took:.0f} s"
                print(head, flush=True)
                if log is not None:
                    log.write(f"{head}\n{output}\n")
                    log.flush()
                try:
                    if rc != 0:
                        raise ValueError(f"exit code {rc}")
                    found = figures(kind, last_json(output))
                except (ValueError, KeyError) as exc:
                    failed += 1
                    print(f"   failed ({exc}); the end of its output:\n{output[-2000:]}")
                    continue
                for figure, value in found.items():
                    results.setdefault(case, {}).setdefault(figure, {}).setdefault(
                        tree, []).append(value)
    print("\nper case and figure: each tree's runs in order, then their median")
    for case, per_figure in results.items():
        for figure, per_tree in per_figure.items():
            for tree, values in per_tree.items():
                runs = " / ".join(f"{v:g}" for v in values)
                print(f"  {case:12s} {figure:6s} {tree:10s} {runs:40s} median "
                      f"{statistics.median(values):g}")
    if args.out:
        with open(os.path.join(args.out, "ab.json"), "w") as f:
            json.dump(results, f, indent=1)
    if log is not None:
        log.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
