"""A checkpoint whose index forgets one shard: the negative control of `kvcal probe --checkpoint` (a writer's bug
that vLLM meets silently: it reads only the shards model.safetensors.index.json lists, so scales stored in an
unlisted shard never load and every layer runs at scale 1.0).

    python scripts/drop_from_index.py CKPT OUT [--shard kv_scales.safetensors]

OUT gets every file of CKPT (hard links where the file system allows, else copies) and an index without the
shard's tensors. Nothing else changes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

INDEX = "model.safetensors.index.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shard", default="kv_scales.safetensors")
    a = ap.parse_args(argv)
    index = a.ckpt / INDEX
    if not index.is_file() or not (a.ckpt / a.shard).is_file():
        print(f"Error: {a.ckpt} has no {INDEX} or no {a.shard}; give a checkpoint folder with both", file=sys.stderr)
        return 2
    if a.out.exists():
        print(f"Error: {a.out} exists; give a new folder", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True)
    for f in a.ckpt.iterdir():
        if f.name != INDEX and f.is_file():
            try:
                os.link(f, a.out / f.name)
            except OSError:
                shutil.copy2(f, a.out / f.name)
    data = json.loads(index.read_text())
    data["weight_map"] = {k: v for k, v in data["weight_map"].items() if v != a.shard}
    (a.out / INDEX).write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
