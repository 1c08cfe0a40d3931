"""Encodes the fortunes corpus's training and validation splits (WORKLOADS.md sections 1
and 5: each split as one string) with Python's SentencePiece (Debian's
python3-sentencepiece), for the C++ tokenizer's test to compare with.

usage: /usr/bin/python3 sp_encode.py MODEL OUT_PREFIX
writes OUT_PREFIX.train and OUT_PREFIX.valid: the token ids as little-endian int32.
"""
import os
import sys

import sentencepiece as spm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_tiny  # noqa: E402


def main():
    model, out = sys.argv[1], sys.argv[2]
    sp = spm.SentencePieceProcessor(model_file=model)
    data, n_train = gpt_tiny.load_fortunes()
    for name, part in (("train", data[:n_train]), ("valid", data[n_train:])):
        ids = sp.encode(part.decode("utf-8"))
        with open(f"{out}.{name}", "wb") as f:
            f.write(b"".join(int(i).to_bytes(4, "little", signed=True) for i in ids))


if __name__ == "__main__":
    main()
