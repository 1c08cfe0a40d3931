#!/usr/bin/env python3
"""The share of expert all-to-all time hidden behind compute, from a Troupe trace.

An all-to-all of op X (the F or B on its stage's track whose span holds it, by micro-batch
and chunk) is hidden where another op Y of the same track computes meanwhile: Y's span
less Y's own all-to-alls. Only an overlapped pair's other op can do that.

    hidden.py TRACE.json [FIRST_STEP]   prints {"all_to_all_s": ..., "hidden_s": ..., "share": ...}
"""
import json
import sys
from collections import defaultdict


def union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def overlap(a, b, intervals):
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in intervals)


def minus(span, holes):
    a, b = span
    out, at = [], a
    for x, y in union(holes):
        if y <= at or x >= b:
            continue
        if x > at:
            out.append((at, x))
        at = max(at, y)
    if at < b:
        out.append((at, b))
    return out


def measure(events, first_step=0):
    ops, a2a = defaultdict(list), defaultdict(list)  # by (replica, stage, step)
    for e in events:
        args = e.get("args", {})
        if args.get("step", -1) < first_step:
            continue
        track = (e.get("pid"), e.get("tid"), args.get("step"))
        span = (e["ts"], e["ts"] + e["dur"])
        if e.get("cat") == "compute" and args.get("op") in ("F", "B"):
            ops[track].append({"key": (args["mb"], args["chunk"]), "span": span, "a2a": []})
        elif e.get("cat") == "all-to-all":
            a2a[track].append(((args["mb"], args["chunk"]), span))
    total = hidden = 0.0
    for track, calls in a2a.items():
        mine = ops.get(track, [])
        for key, (a, b) in calls:
            owner = [o for o in mine if o["key"] == key and o["span"][0] <= a and b <= o["span"][1] + 1]
            if owner:
                owner[0]["a2a"].append((a, b))
        for o in mine:
            for a, b in o["a2a"]:
                total += b - a
                for other in mine:
                    if other is not o and other["span"][0] < b and a < other["span"][1]:
                        hidden += overlap(a, b, minus(other["span"], other["a2a"]))
    return {"all_to_all_s": total * 1e-6, "hidden_s": hidden * 1e-6, "share": hidden / total if total else 0.0}


if __name__ == "__main__":
    trace = json.load(open(sys.argv[1]))["traceEvents"]
    print(json.dumps(measure(trace, int(sys.argv[2]) if len(sys.argv) > 2 else 0)))
