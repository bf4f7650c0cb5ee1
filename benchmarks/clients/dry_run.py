"""Would the clients fit in the project's own venv? pip's dry run says, without installing anything.

    python3 benchmarks/clients/dry_run.py                       # against this checkout's .venv
    python3 benchmarks/clients/dry_run.py --python .venv/bin/python

For each client (pinned as setup.sh pins it) and for all of them together, it asks that venv's pip what
``pip install --dry-run --report`` would install, and lists every package already there whose version would
change. A ``clients`` extra is only safe for the clients that leave torch, transformers and pydantic as they are.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from run_clients import server_python

CLIENTS = {
    "guidellm": ["guidellm==0.8.1"],
    "aiperf": ["aiperf==0.13.0"],
    "lm-eval": ["lm-eval[api]==0.4.13"],
    "instructor": ["instructor==1.17.0"],
    "langchain-openai": ["langchain-openai==1.7.4"],
}
GUARDED = ("torch", "transformers", "pydantic")


def canonical(name: str) -> str:
    return name.lower().replace("_", "-")


def changes(python: str, requirements: list[str], installed: dict[str, str]) -> tuple[int, list[str]]:
    """(how many new packages, ``name old -> new`` for each installed one that would change)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        argv = [python, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), *requirements]
        subprocess.run(argv, check=True, capture_output=True, text=True)
        planned = json.loads(report.read_text())["install"]
    new, changed = 0, []
    for item in planned:
        name, version = canonical(item["metadata"]["name"]), item["metadata"]["version"]
        if name in installed:
            changed.append(f"{name} {installed[name]} -> {version}")
        else:
            new += 1
    return new, changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=server_python())
    args = parser.parse_args()
    listing = subprocess.run([args.python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True)
    installed = {canonical(p["name"]): p["version"] for p in json.loads(listing.stdout)}
    print(f"venv of {args.python}: " + ", ".join(f"{name} {installed.get(name, '-')}" for name in GUARDED))
    print("| clients | new packages | would change | torch, transformers, pydantic kept |")
    print("| --- | --- | --- | --- |")
    unsafe = []
    for label, requirements in [*CLIENTS.items(), ("all five", [r for reqs in CLIENTS.values() for r in reqs])]:
        new, changed = changes(args.python, requirements, installed)
        kept = not any(line.split()[0] in GUARDED for line in changed)
        unsafe += [] if kept else [label]
        print(f"| {label} | {new} | {', '.join(changed) or 'nothing'} | {'yes' if kept else '**no**'} |", flush=True)
    print(f"must stay in their own venv: {', '.join(unsafe) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
