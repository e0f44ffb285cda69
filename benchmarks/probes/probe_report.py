"""What the GPU probes (``copy_probe``, ``host_memory_probe``, ``in_step_probe``) share.

``LLAMA3_8B``: their block geometry (2 MiB a block, 2,048-block GPU pools). ``emit`` prints rows as a markdown table and writes them, with the device, date, torch version and
command, as ``<name>.json`` to ``$OUT`` (default: current directory). Threading: plain functions.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from tiered_kv.copy.testing import Shape

#: Llama-3-8B-shaped blocks: 32 layers, 8 KV heads, head_dim 128, 16 tokens (bf16: 2 MiB a block)
LLAMA3_8B = Shape(layers=32, heads=8, block_size=16, head_dim=128, num_blocks=2048)


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
        "date": time.strftime("%Y-%m-%d"), "command": f"python3 benchmarks/probes/{name}.py",
        "torch": torch.__version__, **extra, "rows": rows}, indent=1))
    return path
