"""The same training benchmark on two revisions of convbn, interleaved on one machine.

A refactor must leave behaviour alone: the same saved bytes and peak (deterministic on
CPU) and the same step time within noise. Step times drift with machine load, so this
script checks out ``--base`` into a temporary git worktree and runs ``convbn bench
--json`` from the base tree and from this tree *alternately*, ``--rounds`` times each,
then prints per model and configuration: the ratios to eager of each revision (the
medians over rounds for time) and the base-to-this difference.

Run::

    python benchmarks/bm_revisions.py --base ee16944 --rounds 3 \\
        --bench "--model monai:resnet50 --batch-size 8 --image-size 224 --configs eager,auto,tutorial"

Every ``--bench`` string is one ``convbn bench`` invocation (repeatable); ``--json``,
``--no-progress`` and ``--no-compile`` are added.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Key = Tuple[str, str, str]  # (bench invocation, model, config)


def _run_bench(src: str, bench: str) -> List[dict]:
    """One ``convbn bench`` run importing convbn from ``src``; its JSON rows."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, PYTHONPATH=src)
        cmd = [sys.executable, "-m", "convbn", "bench", *shlex.split(bench), "--no-progress", "--no-compile",
               "--json", out.name]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"bench failed in {src}: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        with open(out.name) as f:
            return json.load(f)


def _collect(rows: Dict[Key, Dict[str, List[float]]], bench: str, got: List[dict]) -> None:
    for r in got:
        cell = rows.setdefault((bench, r["model"], r["config"]), {"saved": [], "peak": [], "time": []})
        cell["saved"].append(r["activation_ratio"])
        cell["peak"].append(r["peak_ratio"])
        cell["time"].append(r["time_ratio"])


def _spread(values: List[float]) -> str:
    """``median [lowest, highest]`` of one configuration's per-round ratios."""
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare against (e.g. a commit)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per revision")
    parser.add_argument("--bench", action="append", required=True, help="arguments of one `convbn bench` run")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, but got {args.rounds}")
    here = os.path.join(ROOT, "src")
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "-q", "--detach", base_tree, args.base], check=True)
        try:
            results: Dict[str, Dict[Key, Dict[str, List[float]]]] = {"base": {}, "this": {}}
            for r in range(args.rounds):
                for bench in args.bench:
                    order = [("base", os.path.join(base_tree, "src")), ("this", here)]
                    for name, src in order if r % 2 == 0 else reversed(order):
                        got = _run_bench(src, bench)
                        _collect(results[name], bench, got)
                        times = ", ".join(f"{g['config']} {g['time_ratio']:.3f}" for g in got if g["config"] != "eager")
                        print(f"round {r + 1}/{args.rounds} {name}: step time / eager: {times}", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base_tree], check=False)
    print(f"base = {args.base}, this = working tree; medians of {args.rounds} alternating rounds; ratios to eager "
          "(step time: median [lowest, highest] over rounds)")
    print("| model | config | act. bytes base → this | peak base → this | step time base → this |")
    print("|---|---|---:|---:|---:|")
    for key in results["this"]:
        _, model, config = key
        if config == "eager" or key not in results["base"]:
            continue
        b, t = results["base"][key], results["this"][key]
        med = {k: (statistics.median(b[k]), statistics.median(t[k])) for k in ("saved", "peak", "time")}
        print(f"| {model} | {config} | {med['saved'][0]:.3f} → {med['saved'][1]:.3f} | "
              f"{med['peak'][0]:.3f} → {med['peak'][1]:.3f} | {_spread(b['time'])} → {_spread(t['time'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
