"""Ports for test processes that must be told theirs before they start (a coordinator restarted on
the same address, a worker brought back on its port).

A port the kernel hands out for `bind(0)` lies in its ephemeral range, where every outgoing
connection on the machine also takes its local port: between this call and the server's own bind,
any connection (another test's, or a worker's to its coordinator) may take it. So the port is drawn
at random from below that range, where nothing connects from, and checked by binding it here.
Where a process can bind port 0 itself and say which it got (shardserve-coordinator's
--address_file, a worker's --listen=HOST:0), let it instead."""
import random
import socket


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


_handed_out = set()


def free_port():
    """A port nothing holds now, and not one this process was given before (the servers refuse a
    port in use, so two listeners of one test must not be told the same one)."""
    low, high = _ephemeral_range()
    # Below the ephemeral range when there is room (Linux's default leaves 10000..32767), else above.
    ranges = [r for r in ((10000, low - 1), (high + 1, 65535)) if r[1] - r[0] >= 1000]
    if not ranges:
        ranges = [(1024, 65535)]
    rng = random.SystemRandom()
    for _ in range(200):
        first, last = rng.choice(ranges)
        port = rng.randint(first, last)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port in _handed_out:
            continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port outside the ephemeral range after 200 tries")
