"""Megatron-Core's own reader and writer of indexed datasets (.bin/.idx), for the tests
that check Troupe's against them.

usage: python megatron_data.py write PREFIX DTYPE   (uint16 or int32)
         writes PREFIX.bin/.idx with IndexedDatasetBuilder: 40 documents of random ids,
         some of several sequences (add_item ... end_document), and PREFIX.json, the
         stream of their ids in index order
       python megatron_data.py read PREFIX OUT.json
         writes OUT.json: {"dtype": name, "documents": [[ids of document 0], ...]}
         as IndexedDataset reads them (a document's sequences concatenated)
"""
import json
import sys
import warnings

warnings.filterwarnings("ignore")

import numpy  # noqa: E402
import torch  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402


def main():
    what, prefix = sys.argv[1], sys.argv[2]
    if what == "write":
        dtype = getattr(numpy, sys.argv[3])
        high = 60000 if dtype == numpy.uint16 else 150000
        g = torch.Generator().manual_seed(7)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        stream = []
        for d in range(40):
            for _ in range(1 + d % 3):
                seq = torch.randint(0, high, (int(torch.randint(1, 50, (1,), generator=g)),), generator=g)
                builder.add_item(seq)
                stream.extend(int(x) for x in seq)
            builder.end_document()
        builder.finalize(prefix + ".idx")
        json.dump(stream, open(prefix + ".json", "w"))
    else:
        data = IndexedDataset(prefix)
        docs = []
        bounds = data.document_indices
        for d in range(len(bounds) - 1):
            ids = []
            for s in range(bounds[d], bounds[d + 1]):
                ids.extend(int(x) for x in data[s])
            docs.append(ids)
        json.dump({"dtype": data.index.dtype.__name__, "documents": docs}, open(sys.argv[3], "w"))


if __name__ == "__main__":
    sys.exit(main())
