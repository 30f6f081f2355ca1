"""The owner's data: a torch Dataset over the .npy files make_data.py writes. Plain PyTorch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


class NpyClassification(Dataset):
    """`split` ("train" or "val") of the directory: `{split}_x.npy` (float32, n x features), `{split}_y.npy`."""

    def __init__(self, directory: Path, split: str):
        directory = Path(directory)
        try:
            self.x = torch.from_numpy(np.load(directory / f"{split}_x.npy"))
            self.y = torch.from_numpy(np.load(directory / f"{split}_y.npy"))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e.filename} is missing: run make_data.py first") from None
        if len(self.x) != len(self.y):
            raise ValueError(f"{directory}: {len(self.x)} samples but {len(self.y)} labels in {split}")

    @property
    def features(self) -> int:
        return self.x.shape[1]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]
