"""Writes state_dict files as users write them, for the C++ reader's test
(tests/unit/checkpoint_test.cpp, Checkpoint.PythonFilesAsUsersSaveThem).

usage: /usr/bin/python3 save_state_dicts.py OUT_DIR

For every FILE.pt it writes FILE.expected: one line per tensor, in the file's order,
"name dtype dims... : values..." with every value written in full precision (repr).
Files:
  module.pt       torch.save(model.state_dict()): an OrderedDict with _metadata
  views.pt        non-contiguous tensors (a transpose, a strided slice at an offset),
                  tensors sharing one storage, and a tensor saved under two names
  half.pt         bf16, fp16 and fp64 tensors, an empty one and a 0-d one
  renamed.pt      module.pt's records rewritten as PyTorch 2.x lays them out: another
                  archive folder, byteorder, .data/serialization_id, .format_version
  bad-*.pt        what must be refused: a nested dict, a list, big-endian, TorchScript
"""
import collections
import os
import sys
import zipfile

import torch
from torch import nn


def expected(path, sd):
    with open(path, "w") as f:
        for name, t in sd.items():
            dims = " ".join(str(x) for x in t.shape)
            values = " ".join(repr(float(x)) for x in t.detach().double().reshape(-1).tolist())
            f.write(f"{name} {str(t.dtype).replace('torch.', '')} {dims} : {values}\n")


def save(out, stem, sd):
    torch.save(sd, os.path.join(out, stem + ".pt"))
    expected(os.path.join(out, stem + ".expected"), sd)


def main():
    out = sys.argv[1]
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2, bias=False))
    sd = model.state_dict()
    assert isinstance(sd, collections.OrderedDict) and hasattr(sd, "_metadata")
    save(out, "module", sd)

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7
    views = collections.OrderedDict()
    views["transposed"] = base.t()
    views["strided"] = base[1:, ::2]
    views["row"] = base[2]
    views["whole"] = base
    views["again"] = views["whole"]
    save(out, "views", views)

    half = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "fp16": torch.randn(7).to(torch.float16),
        "fp64": torch.randn(2, 2, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }
    save(out, "half", half)

    src = zipfile.ZipFile(os.path.join(out, "module.pt"))
    with zipfile.ZipFile(os.path.join(out, "renamed.pt"), "w", zipfile.ZIP_STORED) as z:
        for name in src.namelist():
            z.writestr("renamed/" + name.split("/", 1)[1], src.read(name))
        z.writestr("renamed/byteorder", "little")
        z.writestr("renamed/.format_version", "1")
        z.writestr("renamed/.storage_alignment", "64")
        z.writestr("renamed/.data/serialization_id", "1234567890")
    expected(os.path.join(out, "renamed.expected"), sd)

    torch.save({"model": model.state_dict(), "step": 3}, os.path.join(out, "bad-nested.pt"))
    torch.save([torch.zeros(2)], os.path.join(out, "bad-list.pt"))
    with zipfile.ZipFile(os.path.join(out, "bad-big-endian.pt"), "w", zipfile.ZIP_STORED) as z:
        for name in src.namelist():
            z.writestr(name, src.read(name))
        z.writestr("module/byteorder", "big")
    torch.jit.save(torch.jit.script(model), os.path.join(out, "bad-torchscript.pt"))


if __name__ == "__main__":
    main()
