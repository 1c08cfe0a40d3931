#!/usr/bin/env python3
"""The goodput study's event model (tests/bench/goodput.py) against what it must give by
arithmetic: no failures leave only the checkpoints' stalls; hangs alone cost Troupe their
detection, rebuild and half a step each; a checkpoint restart loses about half an interval
more than its downtime; more failures never give more goodput."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import goodput  # noqa: E402


def with_(**over):
    return goodput.merged(goodput.INPUTS, over)


class GoodputModel(unittest.TestCase):
    def test_no_failures_leave_the_checkpoint_stalls(self):
        p = with_(interruptions=0, checkpoint_restart={"interval_minutes": 30})
        write, _ = goodput.checkpoint_seconds(p)
        r = goodput.study(p, 2)
        self.assertAlmostEqual(r["checkpoint-restart, spare hosts"]["goodput"], 1800 / (1800 + write), delta=2e-4)
        t = p["troupe"]
        every = t["checkpoint_interval_minutes"] * 60
        self.assertAlmostEqual(r["troupe, no spares"]["goodput"], every / (every + t["checkpoint_stall_seconds"]), delta=2e-4)

    def test_hangs_cost_troupe_their_detection_rebuild_and_half_a_step(self):
        p = with_(split={"process": 0, "node": 0, "hang": 1, "slow": 0})
        t = p["troupe"]
        every = t["checkpoint_interval_minutes"] * 60
        per_failure = t["hang_detect_seconds"] + t["retry_rebuild_seconds"] + p["step_seconds"] / 2
        expected = every / (every + t["checkpoint_stall_seconds"]) * (1 - goodput.rate_per_second(p) * per_failure)
        got = goodput.study(p, 40)["troupe, spare hosts"]["goodput"]
        self.assertAlmostEqual(got, expected, delta=5e-4)

    def test_a_checkpoint_restart_loses_about_half_an_interval_more_than_its_downtime(self):
        p = with_(split={"process": 1, "node": 0, "hang": 0, "slow": 0}, checkpoint_restart={"interval_minutes": 20})
        write, load = goodput.checkpoint_seconds(p)
        cr = p["checkpoint_restart"]
        down = cr["detect_seconds"]["process"] + cr["relaunch_seconds"] + load
        cycle = 1200 + write
        lam = goodput.rate_per_second(p)
        # Per failure: the downtime and, on average, half a cycle of work (failures are
        # uniform within a cycle).
        expected = 1200 / cycle * (1 - lam * (down + cycle / 2))
        got = goodput.study(p, 40)["checkpoint-restart, spare hosts"]["goodput"]
        self.assertAlmostEqual(got, expected, delta=4e-3)

    def test_more_failures_never_give_more_goodput(self):
        runs = [goodput.study(with_(interruptions=419 * f), 10) for f in (0.5, 1, 2)]
        for s in goodput.STRATEGIES:
            self.assertGreater(runs[0][s]["goodput"], runs[1][s]["goodput"], s)
            self.assertGreater(runs[1][s]["goodput"], runs[2][s]["goodput"], s)

    def test_young_interval(self):
        p = goodput.INPUTS
        write, _ = goodput.checkpoint_seconds(p)
        mtbf = 1 / goodput.rate_per_second(p)
        self.assertAlmostEqual(goodput.young_interval(p), (2 * write * mtbf) ** 0.5)


if __name__ == "__main__":
    unittest.main()
