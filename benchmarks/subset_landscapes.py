"""Derive smaller landscapes from the shipped ones, to check that the strategy holds up on
spaces it was not developed against (fewer knobs, no 16-bit precision).

    .venv/bin/python benchmarks/subset_landscapes.py ../shared/landscapes /tmp/subsets
    .venv/bin/autotune bench $(for d in /tmp/subsets/*; do echo --landscape $d; done)
"""

from __future__ import annotations

import csv
import shutil
import sys
from pathlib import Path

SUBSETS = {
    "adamw-z02": lambda r: (r["optim"] in ("adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit")
                            and r["zero_stage"] in ("0", "2") and r["offload"] == "none"),
    "fp32-tf32": lambda r: r["precision"] in ("fp32", "tf32"),
}


def main(src_root: str, dst_root: str) -> None:
    for src in sorted(p for p in Path(src_root).iterdir() if (p / "meta.json").is_file()):
        rows = list(csv.DictReader((src / "trials.csv").open()))
        for tag, keep in SUBSETS.items():
            dst = Path(dst_root) / f"{src.name}-{tag}"
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / "meta.json", dst / "meta.json")
            with (dst / "trials.csv").open("w", newline="") as f:
                writer = csv.DictWriter(f, list(rows[0]))
                writer.writeheader()
                writer.writerows(r for r in rows if keep(r))
            print(dst)


if __name__ == "__main__":
    main(*sys.argv[1:3])
