"""Compares a run that met faults with the fault-free one (tests/faults/restart_test.sh,
tests/faults/soak_test.sh): the same final parameters bit for bit (torch.equal, every tensor),
the same loss for every step of the metrics log, and the expected number of resumes.

    compare_runs.py REF GOT RESUMES [REPLAYED]   (REF.pt, REF.jsonl, GOT.pt, GOT.jsonl)
"""
import json
import sys

import torch

ref, got, resumes_expected = sys.argv[1], sys.argv[2], int(sys.argv[3])
replayed_expected = int(sys.argv[4]) if len(sys.argv) > 4 else None
a, b = torch.load(ref + ".pt"), torch.load(got + ".pt")
assert list(a) == list(b), "different parameter names"
diff = [k for k in a if not torch.equal(a[k], b[k])]
worst = max(((a[k].double() - b[k].double()).abs().max().item() for k in diff), default=0.0)
assert not diff, f"parameters differ: {diff[:3]} ({len(diff)} of {len(a)}, by up to {worst:.3e})"


def read(path):
    lines = [json.loads(line) for line in open(path)]
    losses = {line["step"]: line["loss"] for line in lines if "loss" in line}
    return losses, lines


ra, _ = read(ref + ".jsonl")
rb, lines = read(got + ".jsonl")
assert ra == rb, f"loss logs differ: {sorted(set(ra.items()) ^ set(rb.items()))[:4]}"
resumes = [line for line in lines if line.get("event") == "resume"]
aborts = [line for line in lines if line.get("event") == "abort"]
assert len(resumes) == resumes_expected, f"{len(resumes)} resumes, expected {resumes_expected}: {resumes}"
if replayed_expected is not None:
    assert all(r["replayed_steps"] == replayed_expected for r in resumes), resumes
replayed = sum(r["replayed_steps"] for r in resumes)
to_step = [r.get("seconds_from_failure_to_step", -1) for r in resumes]
print(f"{len(ra)} steps, {len(resumes)} resume(s), {len(aborts)} abort line(s), {replayed} step(s) replayed, "
      f"failure to next step {', '.join(f'{t:.1f}' for t in to_step) or '-'} s")
