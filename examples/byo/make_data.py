"""Write the example's data set: a synthetic but learnable 4-class problem over 12 features, as .npy files.

    python make_data.py            # writes data/{train,val}_{x,y}.npy (about 200 KB), the same bytes every time

The label is which side of two curved boundaries (a wave and a bowl, each in a plane of two random directions) a
sample lies on, with 3% of the labels redrawn at random: a linear model stays below 90% accuracy, a small MLP gets
above it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

FEATURES, CLASSES = 8, 4


def make(n: int, rng: np.random.Generator, directions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    a, b, c, d = (x @ directions).T
    wavy = a + 0.5 * np.sin(1.5 * b)
    bowl = c - 0.6 * (d * d - 1.0)
    y = 2 * (wavy > 0) + (bowl > 0)
    flip = rng.random(n) < 0.03
    y[flip] = rng.integers(0, CLASSES, size=flip.sum())
    return x, y.astype(np.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data")
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--val", type=int, default=1000)
    args = parser.parse_args()
    rng = np.random.default_rng(20240611)
    directions = np.linalg.qr(rng.standard_normal((FEATURES, 4)))[0].astype(np.float32)  # 4 orthonormal columns
    args.out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", args.train), ("val", args.val)):
        x, y = make(n, rng, directions)
        np.save(args.out / f"{split}_x.npy", x)
        np.save(args.out / f"{split}_y.npy", y)
    total = sum(f.stat().st_size for f in args.out.glob("*.npy"))
    print(f"wrote {args.train} training and {args.val} validation samples to {args.out} ({total // 1024} KB)")


if __name__ == "__main__":
    main()
