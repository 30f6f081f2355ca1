"""Split the byo example's data into non-IID parts, one per node, as federated clients' data usually are.

    python ../byo/make_data.py && python split_data.py --parts 3 --out parts

Part i holds the training samples of every class but one (class i, modulo 4), so no node sees every class and
every node's labels are skewed; every part holds the whole validation split, which the workload's evaluate reads.
Point each node's `datasets` setting at its part: datasets = {"byo-part" = ".../parts/0"}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

CLASSES = 4


def split(source: Path, out: Path, parts: int) -> list[Path]:
    x, y = np.load(source / "train_x.npy"), np.load(source / "train_y.npy")
    written = []
    for i in range(parts):
        keep = y != i % CLASSES
        part = out / str(i)
        part.mkdir(parents=True, exist_ok=True)
        np.save(part / "train_x.npy", x[keep])
        np.save(part / "train_y.npy", y[keep])
        for name in ("val_x.npy", "val_y.npy"):
            np.save(part / name, np.load(source / name))
        written.append(part)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = Path(__file__).resolve().parent
    parser.add_argument("--source", type=Path, default=here.parent / "byo" / "data")
    parser.add_argument("--out", type=Path, default=here / "parts")
    parser.add_argument("--parts", type=int, default=3)
    args = parser.parse_args()
    for part in split(args.source, args.out, args.parts):
        print(f"{part}: {len(np.load(part / 'train_y.npy'))} training samples, classes "
              f"{sorted(set(np.load(part / 'train_y.npy').tolist()))}")


if __name__ == "__main__":
    main()
