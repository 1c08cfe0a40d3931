#!/usr/bin/python3
"""Prints a free TCP port below the kernel's ephemeral range.

A port from that range can be taken by an outgoing connection (UCX over TCP opens many)
between this check and the listen of whoever asked. 10000-19999 also stays clear of the
gtests' fixed node ports (24000 and up).
"""
import random
import socket

with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
    lowest_ephemeral = int(f.read().split()[0])
for _ in range(200):
    port = random.randrange(10000, max(10001, min(20000, lowest_ephemeral)))
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            continue
    print(port)
    break
else:  # all taken: any free port
    with socket.socket() as s:
        s.bind(("", 0))
        print(s.getsockname()[1])
