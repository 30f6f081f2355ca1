"""Load the model a finished job left (`gpuswarm job download JOB_ID`) in plain PyTorch, and evaluate it.

    python load_model.py model.pt              # validation accuracy on data/val_*.npy

Nothing here imports gpuswarm: the file is a dict of plain data and tensors, and the model class is our own.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from mymodel.data import NpyClassification
from mymodel.model import MyNet


def load(path: Path) -> tuple[MyNet, dict]:
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved.get("format") != "gpuswarm-model/1":
        raise SystemExit(f"{path}: not a gpuswarm model file (format {saved.get('format')!r})")
    params = saved["params"]  # the job's params, as validated (defaults filled in)
    model = MyNet(features=saved["state_dict"]["inp.weight"].shape[1], hidden=params["hidden"],
                  depth=params["depth"])
    model.load_state_dict(saved["state_dict"])
    return model.eval(), saved


def main() -> None:
    parser = argparse.ArgumentParser(description="Evaluate a downloaded model on the validation files.")
    parser.add_argument("model", type=Path)
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parent / "data")
    args = parser.parse_args()
    model, saved = load(args.model)
    val = NpyClassification(args.data, "val")
    with torch.no_grad():
        accuracy = (model(val.x).argmax(1) == val.y).float().mean().item()
    print(f"{args.model}: validation accuracy {accuracy:.4f} "
          f"(the job reported {saved['metrics']}, step {saved['metadata'].get('global_step')})")


if __name__ == "__main__":
    main()
