"""Tokenizer and preprocessing figures (docs/performance.md), each against its reference
in the same run. Run by tests/bench/tokenizer with the transformers 5 environment's python.

usage: python tokenizer_bench.py TROUPE OUT MEGABYTES
- A corpus of MEGABYTES of JSON lines (the fortunes corpus's fortunes, shuffled and
  repeated, with a counter so that words vary), and a byte-level BPE tokenizer with Llama
  3's split regex (tokenizer_folders.py llama3).
- Encoding MB/s on one thread and on all: `troupe preprocess` (JSON lines to a Megatron
  dataset) against `tokenizers`' Tokenizer.encode_batch over the same documents (the text
  in memory, RAYON_NUM_THREADS=1 for one thread) driving Megatron-Core's
  IndexedDatasetBuilder (what preprocess_data.py does; the JSON read included).
- The time to the first step of a job (one process, train --steps 1) on the Megatron
  dataset of the whole corpus against
  the same job on a dataset of one megabyte: the data's share of the wait.
"""
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "support", "python"))


def make_corpus(path, megabytes):
    text = open("/usr/share/games/fortunes/fortunes", encoding="utf-8", errors="replace").read()
    fortunes = [f for f in text.split("\n%\n") if f.strip()]
    rng = random.Random(5)
    size, n = 0, 0
    with open(path, "w") as out:
        while size < megabytes * 1_000_000:
            rng.shuffle(fortunes)
            for f in fortunes:
                line = json.dumps({"text": "%d. %s" % (n, f)}) + "\n"
                out.write(line)
                size += len(line)
                n += 1
                if size >= megabytes * 1_000_000:
                    break
    return size


def reference(folder, corpus, prefix, threads):
    """tokenizers + IndexedDatasetBuilder in a process of its own (RAYON_NUM_THREADS)."""
    code = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import numpy
from tokenizers import Tokenizer
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
folder, corpus, prefix = sys.argv[1:4]
tok = Tokenizer.from_file(folder + "/tokenizer.json")
eos = json.load(open(folder + "/config.json"))["eos_token_id"]  # WORKLOADS.md section 6's EOS
t0 = time.time()
builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
batch, tokens, encode = [], 0, 0.0
def flush():
    global tokens, encode
    e0 = time.time()
    out = tok.encode_batch(batch)
    encode += time.time() - e0
    for enc in out:
        ids = enc.ids + [eos]
        builder.add_document(ids, [len(ids)])
        tokens += len(ids)
    batch.clear()
with open(corpus) as f:
    for line in f:
        batch.append(json.loads(line)["text"])
        if len(batch) == 10000:
            flush()
flush()
builder.finalize(prefix + ".idx")
print(json.dumps({"seconds": time.time() - t0, "encode_seconds": encode, "tokens": tokens}))
"""
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", code, folder, corpus, prefix], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def troupe_preprocess(troupe, folder, corpus, prefix, threads):
    t0 = time.time()
    subprocess.run([troupe, "preprocess", "--data", corpus, "--model", folder, "--out", prefix, "--threads",
                    str(threads)], check=True, capture_output=True)
    return time.time() - t0


def first_step(troupe, folder, prefix, out):
    t0 = time.time()
    subprocess.run([troupe, "train", "--pipeline", "1", "--data-parallel", "1", "--microbatches", "1",
                    "--model", folder, "--data", prefix, "--steps", "1", "--eval-interval", "0",
                    "--global-batch", "4", "--seq-len", "24", "--cache-dir", out + "/cache"],
                   check=True, capture_output=True)
    return time.time() - t0


def main():
    troupe, out, megabytes = sys.argv[1], sys.argv[2], float(sys.argv[3])
    subprocess.run([sys.executable, os.path.join(HERE, "..", "support", "python", "hf_families.py"), out, "llama3"],
                   check=True, capture_output=True)
    subprocess.run([sys.executable, os.path.join(HERE, "..", "support", "python", "tokenizer_folders.py"),
                    out + "/tok", "--vocab=300", "llama3"], check=True, capture_output=True)
    folder = out + "/llama3"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.replace(out + "/tok/llama3/" + f, folder + "/" + f)
    corpus = out + "/corpus.jsonl"
    size = make_corpus(corpus, megabytes)
    cores = os.cpu_count()
    print("corpus: %.0f MB of JSON lines; tokenizer: byte-level BPE, Llama 3's regex, 300 ids; %d cores"
          % (size / 1e6, cores))
    print("%-28s %10s %10s %8s" % ("", "Troupe", "reference", "ratio"))
    for threads in sorted({1, cores}):
        ref = reference(folder, corpus, out + "/ref", threads)
        mine = troupe_preprocess(troupe, folder, corpus, out + "/mine", threads)
        a, b = size / mine / 1e6, size / ref["seconds"] / 1e6
        print("%-28s %8.1f MB/s %8.1f MB/s %7.2fx   (reference's encode_batch alone: %.1f MB/s)"
              % ("preprocess, %d thread%s" % (threads, "" if threads == 1 else "s"), a, b, a / b,
                 size / ref["encode_seconds"] / 1e6))
        same = open(out + "/mine.bin", "rb").read() == open(out + "/ref.bin", "rb").read()
        print("  same .bin as the reference: %s" % same)
    os.replace(out + "/mine.bin", out + "/big.bin")  # the last run's dataset: the whole corpus
    os.replace(out + "/mine.idx", out + "/big.idx")
    with open(out + "/small.jsonl", "w") as f:
        for line in open(corpus):
            f.write(line)
            if f.tell() > 1_000_000:
                break
    subprocess.run([troupe, "preprocess", "--data", out + "/small.jsonl", "--model", folder, "--out", out + "/small"],
                   check=True, capture_output=True)
    os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null")
    big, small = first_step(troupe, folder, out + "/big", out), first_step(troupe, folder, out + "/small", out)
    print("train --steps 1 on the Megatron dataset of %.0f MB: %.1f s; on one of 1 MB: %.1f s (ratio %.2f)"
          % (os.path.getsize(out + "/big.bin") / 1e6, big, small, big / small))


if __name__ == "__main__":
    sys.exit(main())
