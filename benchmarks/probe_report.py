"""Shared output of the GPU probes (``copy_probe``, ``host_memory_probe``, ``in_step_probe``).

``emit`` prints rows as a markdown table and writes them, with the device, date, torch version and
command, as ``<name>.json`` to ``$OUT`` (default: current directory). Threading: plain functions.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch


def emit(name: str, rows: list[dict], cols: list[str], **extra) -> Path:
    """Print ``rows`` (columns ``cols``; a missing cell shows the row's ``error``) and write the JSON."""
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, r.get("error", ""))) for k in cols) + " |")
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "date": time.strftime("%Y-%m-%d"), "command": f"python3 benchmarks/{name}.py",
        "torch": torch.__version__, **extra, "rows": rows}, indent=1))
    return path
