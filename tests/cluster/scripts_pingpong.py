"""TCP helper for the link tests, run inside an emulated node (standard library only).

    scripts_pingpong.py serve ADDR PORT          echo everything back; prints "up" once listening
    scripts_pingpong.py ping ADDR PORT N         N round trips of 32 bytes; prints the median seconds
    scripts_pingpong.py sink ADDR PORT           print the sha256 and length of everything received,
                                                 and the seconds from its first byte to the end
    scripts_pingpong.py send ADDR PORT MIB SEED  send MIB MiB of seeded random bytes; print their sha256
"""

import hashlib
import random
import socket
import statistics
import sys
import time

mode, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode in ("serve", "sink"):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen()
    print("up", flush=True)
    s.settimeout(60)
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    digest, total, first = hashlib.sha256(), 0, None
    while data := c.recv(1 << 16):
        first = first or time.perf_counter()
        if mode == "serve":
            c.sendall(data)
        digest.update(data)
        total += len(data)
    print(digest.hexdigest(), total, time.perf_counter() - (first or time.perf_counter()), flush=True)
else:
    c = socket.create_connection((addr, port), timeout=60)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if mode == "ping":
        rtts = []
        for _ in range(int(sys.argv[4])):
            start = time.perf_counter()
            c.sendall(b"x" * 32)
            got = 0
            while got < 32:
                got += len(c.recv(64))
            rtts.append(time.perf_counter() - start)
        print(statistics.median(rtts[3:]), flush=True)  # the first trips open the congestion window
    else:
        data = random.Random(int(sys.argv[5])).randbytes(int(float(sys.argv[4]) * 2**20))
        c.sendall(data)
        print(hashlib.sha256(data).hexdigest(), len(data), flush=True)
    c.close()
