"""A run's op times from its Chrome trace (`--trace`), and the schedule simulator's view of
them (`troupe schedule --format json`): what the benchmarks that compare a measured step
with the simulated one share (tests/bench/schedules/run, tests/bench/gpu_bench.py)."""
import json
import statistics
import subprocess


def op_means(trace, first_step=1):
    """Mean F, B and W times in ms of the stages' compute events from step `first_step` on
    (on a GPU the op clock's GPU times). A backward whose W was split off counts B + W;
    "W" is None when no backward was split."""
    dur = {}  # (op, step, replica, stage, mb, chunk) -> us
    for e in json.load(open(trace))["traceEvents"]:
        if e.get("cat") == "compute" and e["args"]["step"] >= first_step:
            a = e["args"]
            dur[(a["op"], a["step"], a["replica"], a["stage"], a["mb"], a["chunk"])] = e["dur"]
    w_of = {key[1:]: v for key, v in dur.items() if key[0] == "W"}
    return {"F": statistics.mean(v for key, v in dur.items() if key[0] == "F") / 1e3,
            "B": statistics.mean(v + w_of.get(key[1:], 0.0) for key, v in dur.items() if key[0] == "B") / 1e3,
            "W": statistics.mean(w_of.values()) / 1e3 if w_of else None}


def simulate(troupe, kind, stages, microbatches, chunks, ops):
    """`troupe schedule`'s simulation (bubble, makespan, ...) of the kind with the mean op
    times of `op_means` (without a split W: the simulator's default half of B)."""
    cmd = [troupe, "schedule", "--kind", kind, "--stages", str(stages), "--microbatches", str(microbatches),
           "--chunks", str(chunks), "--format", "json", "--forward-cost", str(ops["F"]),
           "--backward-cost", str(ops["B"])]
    if ops["W"] is not None:
        cmd += ["--weight-cost", str(ops["W"])]
    return json.loads(subprocess.check_output(cmd))
