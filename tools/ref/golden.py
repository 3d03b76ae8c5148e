"""Shared helpers for the reference scripts that write tests/golden/.

Every golden file is a small safetensors file whose metadata records the script that wrote it,
the seed and the format version; the C++ tests check the version and say how to regenerate.
"""
import os
import sys

import torch
from safetensors.torch import save_file

FORMAT_VERSION = "1"
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GOLDEN = os.path.join(ROOT, "tests", "golden")


def save(relpath, tensors, seed, **meta):
    path = os.path.join(GOLDEN, relpath)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    metadata = {
        "script": "tools/ref/" + os.path.basename(sys.argv[0]),
        "seed": str(seed),
        "format_version": FORMAT_VERSION,
        "torch": torch.__version__,
    }
    metadata.update({k: str(v) for k, v in meta.items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)
    print(f"wrote {os.path.relpath(path, ROOT)} ({len(tensors)} tensors)")
