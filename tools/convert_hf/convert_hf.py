#!/usr/bin/env python
"""Thin CLI over threed.cli.convert (the same commands as `threed convert|export|reshard|verify|make-tiny-hf`).

python tools/convert_hf/convert_hf.py convert --hf Meta-Llama-3-8B --tp 2 --pp 2 --out ckpt/l3-8b
python tools/convert_hf/convert_hf.py export --ckpt runs/l3-8b --out runs/l3-8b-hf
"""

from __future__ import annotations

import sys

COMMANDS = ("convert", "export", "reshard", "verify", "make-tiny-hf")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: convert_hf.py {{{','.join(COMMANDS)}}} ... (see --help of each)", file=sys.stderr)
        return 2
    from threed.cli.main import main as threed_main

    return threed_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
