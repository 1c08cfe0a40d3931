#!/usr/bin/env python3
"""Goodput of a week of a 16,384-GPU job under failures (docs/goodput.md): an event model.

Failures arrive as a Poisson process (a rate per node-hour, by default the Llama 3 405B
report's 419 unexpected interruptions in 54 days on 16,384 GPUs), each of a kind: a
process lost (its host is fine), a node lost (its host is gone), a hang, or a slow node.
Each strategy answers each kind with a downtime, lost work and, for some, a period at a
lower speed; the model replays a week of them, several times with other seeds, and
reports goodput (useful training time / wall time) and the GPU-hours lost.

Recoveries:
  checkpoint-restart  every failure stops the job: detected after the kind's timeout, the
                      job is launched again and loads the newest checkpoint (every N
                      minutes, written synchronously); the work since it is lost.
  troupe              a lost process: its node process starts again and rejoins from the
                      buddy copies (the step runs again); a hang: the watchdog finds it and
                      the step is retried in place; checkpoints are asynchronous.
each with spare hosts (a lost host's place is taken at once: for Troupe its node process
started on the spare rejoins, which the launcher does not do yet: it restarts a lost
process on its own host only) or without (the job restarts from its newest checkpoint on
fewer nodes, at the largest layout that fits: launch/troupe --min-nodes, and takes the
repaired host back later with one more restart: --regrow-interval).

Usage: goodput.py [--inputs FILE.json] [--seeds N] [--format markdown|json]
FILE.json overrides any of the inputs below (same keys, nested as here).
"""
import argparse
import copy
import json
import math
import random
import statistics
import sys

INPUTS = {
    "gpus": 16384,
    "gpus_per_node": 8,
    "hours": 168,
    "step_seconds": 10.0,
    # Llama 3 report (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in a
    # 54-day snapshot of 16,384-GPU pre-training, 78 % of them confirmed or suspected
    # hardware. The split below maps its categories onto the four kinds (assumed).
    "interruptions": 419,
    "days": 54,
    "split": {"process": 0.13, "node": 0.78, "hang": 0.06, "slow": 0.03},
    "slow": {"speed": 0.5, "detect_seconds": 1800},  # a slow node drags every step until removed
    # The model's state: Llama 3 8B's shape (the 16k-rank benchmark's job), fp32 main
    # parameters and AdamW's two moments plus bf16 weights: 14 bytes per parameter.
    "parameters": 8.03e9,
    "bytes_per_parameter": 14,
    "storage_write_gbps": 20.0,  # aggregate, to the checkpoint store (assumed)
    "storage_read_gbps": 40.0,
    "checkpoint_restart": {
        "interval_minutes": None,  # None: Young's optimum sqrt(2 C MTBF)
        "detect_seconds": {"process": 60, "node": 60, "hang": 600, "slow": 0},  # hang: NCCL's default timeout
        "relaunch_seconds": 300,  # scheduler, 16k processes, NCCL communicators, data loaders (assumed)
    },
    # Troupe's measured recoveries (docs/performance.md: tests/bench/faults on this machine's
    # node processes; the 16,384-rank ones by simulation, 2,048 simulated nodes of 8 ranks:
    # tests/bench/simulated 16k-nodes 16k-lost), and its asynchronous checkpoints.
    "troupe": {
        "connection_seconds": 0.05,  # a killed node process: its connection drops (tests/bench/faults)
        "host_timeout_seconds": 5.0,  # a host gone: the connection timeout (tests/faults/fence_test.sh)
        "process_restart_seconds": 2.0,  # the launcher's back-off, a node process's start and rejoin (tests/bench/faults)
        "rejoin_rebuild_seconds": 2.10,  # 2,048 simulated nodes (16k-lost): the median of 3 runs, 2.46 s, less the modelled all-gather's 50x scaling (0.36 s; 7 ms unscaled): the address exchange and every node's actors rebuilt
        "hang_detect_seconds": 40.4,  # hang_factor 4 x the 10 s median step, and the 0.4 s the probe took at 16,384 ranks
        "retry_rebuild_seconds": 1.78,  # 2,048 simulated nodes (16k-throw): the median of 3 runs, 2.14 s, less the all-gather's scaling: the address exchange and every actor respawned
        "launch_to_first_step_seconds": 2.0,  # 2,048 simulated nodes (16k-nodes): the job's start to its first step's begin, the join's address exchange included
        "relaunch_seconds": 300,  # the same processes and communicators as a checkpoint restart's (assumed)
        "checkpoint_interval_minutes": 10,
        "checkpoint_stall_seconds": 1.0,  # asynchronous: the copy out of the step (assumed)
        "shrink_speed": 0.5,  # 2,047 of 2,048 nodes: the largest fitting layout is DP 64 of 128
        "repair_hours": 4.0,  # the host back, regrown at the next check (assumed)
    },
}


def merged(base, over):
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def per_node_hour(p):
    """Failures per node-hour: the report's interruptions over its node-hours."""
    return p["interruptions"] / (p["days"] * 24 * (p["gpus"] / p["gpus_per_node"]))


def rate_per_second(p):
    """Failures per second of the whole job."""
    return per_node_hour(p) * p["gpus"] / p["gpus_per_node"] / 3600


def checkpoint_seconds(p):
    """(synchronous write, load) of the model's state."""
    size = p["parameters"] * p["bytes_per_parameter"] / 1e9
    return size / p["storage_write_gbps"], size / p["storage_read_gbps"]


def young_interval(p):
    write, _ = checkpoint_seconds(p)
    return math.sqrt(2 * write / rate_per_second(p))


class Job:
    """A job's week: wall time `t`, useful time `useful` (full-speed training seconds kept),
    checkpoints every `interval` s of training (each stalling `stall` s, and kept once the
    stall ends: a failure during it loses the checkpoint), the speed it trains at."""

    def __init__(self, interval, stall):
        self.t = 0.0
        self.useful = 0.0
        self.pending = 0.0  # useful time since the newest checkpoint
        self.cycle = 0.0    # wall time into the current checkpoint cycle (work, then stall)
        self.interval, self.stall = interval, stall
        self.speed = 1.0

    def train(self, until):
        while self.t < until:
            if self.cycle < self.interval:
                dt = min(self.interval - self.cycle, until - self.t)
                self.pending += dt * self.speed
            else:
                dt = min(self.interval + self.stall - self.cycle, until - self.t)
            self.t += dt
            self.cycle += dt
            if self.cycle >= self.interval + self.stall - 1e-9:
                self.useful += self.pending
                self.pending = 0.0
                self.cycle = 0.0

    def lose_since_checkpoint(self):
        self.pending = 0.0
        self.cycle = 0.0

    def lose_partial_step(self, step, rng):
        lost = min(self.pending, rng.uniform(0, step) * self.speed)
        self.pending -= lost

    def down(self, seconds):
        self.t += seconds

    def end(self, horizon):
        self.train(horizon)
        self.useful += self.pending  # the run's end keeps what it trained
        self.pending = 0.0


def week(strategy, p, rng):
    """Useful time over wall time of one week of `strategy` (a STRATEGIES key)."""
    recovery, spares = STRATEGIES[strategy]
    horizon = p["hours"] * 3600
    lam = rate_per_second(p)
    kinds, weights = zip(*p["split"].items())
    write, load = checkpoint_seconds(p)
    cr, tr = p["checkpoint_restart"], p["troupe"]
    if recovery == "checkpoint-restart":
        job = Job(cr["interval_minutes"] * 60 if cr["interval_minutes"] else young_interval(p), write)
        relaunch = cr["relaunch_seconds"] + load
    else:
        job = Job(tr["checkpoint_interval_minutes"] * 60, tr["checkpoint_stall_seconds"])
        relaunch = tr["relaunch_seconds"] + load + tr["launch_to_first_step_seconds"]
    regrow_at = None  # without spares: when the shrunk job takes the repaired host back
    t_fail = rng.expovariate(lam) if lam > 0 else math.inf
    while True:
        if regrow_at is not None and regrow_at < min(t_fail, horizon):
            job.train(regrow_at)  # a planned stop at a checkpoint, relaunched on every node
            job.useful += job.pending
            job.lose_since_checkpoint()
            job.down(relaunch)
            job.speed = 1.0
            regrow_at = None
            continue
        if t_fail >= horizon:
            break
        job.train(max(t_fail, job.t))
        kind = rng.choices(kinds, weights)[0]
        if kind == "slow":  # every step at the slow node's speed until it is found; then removed as a lost host
            shrunk = job.speed
            job.speed = min(job.speed, p["slow"]["speed"])
            job.train(min(job.t + p["slow"]["detect_seconds"], horizon))
            job.speed = shrunk
            kind = "node"
        if recovery == "checkpoint-restart" and (kind != "node" or spares):
            job.down(cr["detect_seconds"][kind])
            job.lose_since_checkpoint()
            job.down(relaunch)
        elif kind == "hang":
            job.down(tr["hang_detect_seconds"])
            job.lose_partial_step(p["step_seconds"], rng)
            job.down(tr["retry_rebuild_seconds"])
        elif kind == "process" or spares:  # the node process again (on a spare host): it rejoins
            job.down(tr["connection_seconds"] if kind == "process" else tr["host_timeout_seconds"])
            job.lose_partial_step(p["step_seconds"], rng)
            job.down(tr["process_restart_seconds"] + tr["rejoin_rebuild_seconds"])
        else:  # a host gone, none to take its place: the job restarts from its checkpoint on fewer nodes
            job.down(cr["detect_seconds"]["node"] if recovery == "checkpoint-restart" else tr["host_timeout_seconds"])
            job.lose_since_checkpoint()
            job.down(relaunch)
            job.speed = tr["shrink_speed"]
            regrow_at = job.t + tr["repair_hours"] * 3600
        t_fail = max(t_fail, job.t) + rng.expovariate(lam)
    job.end(horizon)
    return job.useful / horizon


# name: (how failures are recovered, whether a spare host takes a lost one's place)
STRATEGIES = {
    "checkpoint-restart, spare hosts": ("checkpoint-restart", True),
    "troupe, spare hosts": ("troupe", True),
    "checkpoint-restart, no spares": ("checkpoint-restart", False),
    "troupe, no spares": ("troupe", False),
}


def study(p, seeds):
    out = {}
    for s in STRATEGIES:
        runs = [week(s, p, random.Random(seed)) for seed in range(seeds)]
        g = statistics.mean(runs)
        out[s] = {"goodput": g, "stdev": statistics.stdev(runs) if len(runs) > 1 else 0.0,
                  "gpu_hours_lost": (1 - g) * p["hours"] * p["gpus"]}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs", help="JSON overriding the inputs")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--format", choices=("markdown", "json"), default="markdown")
    a = ap.parse_args()
    p = INPUTS
    if a.inputs:
        with open(a.inputs) as f:
            p = merged(p, json.load(f))
    base = study(p, a.seeds)
    sens = {}
    for factor in (0.25, 0.5, 1, 2, 4):
        q = merged(p, {"interruptions": p["interruptions"] * factor})
        sens[factor] = study(q, a.seeds)
    relaunch = {}
    for seconds in (60, 300, 900):
        q = merged(p, {"checkpoint_restart": {"relaunch_seconds": seconds}, "troupe": {"relaunch_seconds": seconds}})
        relaunch[seconds] = study(q, a.seeds)
    shrink = {}
    for speed in (0.5, 0.9, 127 / 128):
        shrink[speed] = study(merged(p, {"troupe": {"shrink_speed": speed}}), a.seeds)
    write, load = checkpoint_seconds(p)
    facts = {"per_node_hour": per_node_hour(p), "failures_per_week": rate_per_second(p) * p["hours"] * 3600, "mtbf_hours": 1 / rate_per_second(p) / 3600,
             "checkpoint_write_seconds": write, "checkpoint_load_seconds": load,
             "young_interval_minutes": young_interval(p) / 60}
    if a.format == "json":
        json.dump({"inputs": p, "facts": facts, "result": base, "rate_factor": {str(k): v for k, v in sens.items()},
                   "relaunch_seconds": {str(k): v for k, v in relaunch.items()},
                   "shrink_speed": {str(k): v for k, v in shrink.items()}}, sys.stdout, indent=1)
        print()
        return
    print(f"{facts['per_node_hour']:.3g} failures per node-hour: {facts['failures_per_week']:.1f} a week (one every {facts['mtbf_hours']:.2f} h); checkpoint "
          f"{write:.1f} s to write, {load:.1f} s to load; checkpoint-restart every "
          f"{facts['young_interval_minutes']:.1f} min (Young); {a.seeds} weeks per figure\n")
    print("| strategy | goodput | GPU-hours lost in the week |")
    print("| --- | --- | --- |")
    for s, r in base.items():
        print(f"| {s} | {r['goodput']:.4f} (sd {r['stdev']:.4f}) | {r['gpu_hours_lost']:,.0f} |")
    print("\nfailure rate times the Llama 3 report's (goodput)\n")
    print("| rate | " + " | ".join(STRATEGIES) + " |")
    print("| --- |" + " --- |" * len(STRATEGIES))
    for factor, r in sens.items():
        print(f"| x{factor:g} | " + " | ".join(f"{r[s]['goodput']:.4f}" for s in STRATEGIES) + " |")
    print("\na job's relaunch (goodput)\n")
    print("| relaunch | " + " | ".join(STRATEGIES) + " |")
    print("| --- |" + " --- |" * len(STRATEGIES))
    for seconds, r in relaunch.items():
        print(f"| {seconds} s | " + " | ".join(f"{r[s]['goodput']:.4f}" for s in STRATEGIES) + " |")

    print("\nwithout spares, the shrunk job's speed until the host is back (goodput)\n")
    print("| shrunk speed | " + " | ".join(STRATEGIES) + " |")
    print("| --- |" + " --- |" * len(STRATEGIES))
    for speed, r in shrink.items():
        print(f"| {speed:.3f} | " + " | ".join(f"{r[s]['goodput']:.4f}" for s in STRATEGIES) + " |")


if __name__ == "__main__":
    main()
