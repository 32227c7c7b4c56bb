#!/usr/bin/env python3
"""A weight-snapshot subscriber in plain Python, speaking the protocol of docs/launcher.md,
"Weight snapshots": no Loom, no third-party module (the xxhash package is used when present).

    python3 weights_client.py HOST:PORT [NEWER_THAN]

prints the newest version's number and tensors as JSON (float32, float64, int32 and int64
values decoded with the array module; with torch: torch.frombuffer(raw, dtype=...).reshape(shape)).
"""
import array
import json
import socket
import struct
import sys

M = (1 << 64) - 1
P1, P2, P3 = 11400714785074694791, 14029467366897019727, 1609587929392839161
P4, P5 = 9650029242287828579, 2870177450012600261


def _rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & M


def _round(acc, lane):
    return (_rotl((acc + lane * P2) & M, 31) * P1) & M


def xxh64(data, seed=0):
    """xxHash64, the checksum of every version (slow in pure Python: use the xxhash package
    for large models)."""
    try:
        import xxhash
        return xxhash.xxh64_intdigest(data, seed)
    except ImportError:
        pass
    n, i = len(data), 0
    if n >= 32:
        v = [(seed + P1 + P2) & M, (seed + P2) & M, seed, (seed - P1) & M]
        while i + 32 <= n:
            lanes = struct.unpack_from("<4Q", data, i)
            v = [_round(a, b) for a, b in zip(v, lanes)]
            i += 32
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & M
        for a in v:
            h = ((h ^ _round(0, a)) * P1 + P4) & M
    else:
        h = (seed + P5) & M
    h = (h + n) & M
    while i + 8 <= n:
        h ^= _round(0, struct.unpack_from("<Q", data, i)[0])
        h = (_rotl(h, 27) * P1 + P4) & M
        i += 8
    if i + 4 <= n:
        h ^= (struct.unpack_from("<I", data, i)[0] * P1) & M
        h = (_rotl(h, 23) * P2 + P3) & M
        i += 4
    while i < n:
        h ^= (data[i] * P5) & M
        h = (_rotl(h, 11) * P1) & M
        i += 1
    h = ((h ^ (h >> 33)) * P2) & M
    h = ((h ^ (h >> 29)) * P3) & M
    return h ^ (h >> 32)


def latest(address, newer_than=-1, timeout_ms=30000):
    """The newest version newer than `newer_than`: (version, {name: (dtype, shape, bytes)})."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host.strip("[]"), int(port))) as s:
        request = {"newer_than": newer_than, "timeout_ms": timeout_ms}
        s.sendall((json.dumps(request) + "\n").encode())
        stream = s.makefile("rb")
        header = json.loads(stream.readline())
        if header.get("format") != "loom-weights" or header.get("format_version") != 1:
            raise RuntimeError(f"{address} is not a Loom weights publisher (format 1)")
        if header["status"] != "ok":  # "none", "closed" or "busy"
            raise RuntimeError(f"{header['status']}: newest {header['latest']}; "
                               f"{header.get('message', '')}")
        data = stream.read(header["bytes"])
        if len(data) != header["bytes"]:
            raise RuntimeError(f"the publisher closed after {len(data)} of {header['bytes']} bytes")
        if xxh64(data) != int(header["xxhash64"], 16):
            raise RuntimeError(f"version {header['version']} does not match its xxHash64")
        return header["version"], {
            t["name"]: (t["dtype"], t["shape"], data[t["offset"]:t["offset"] + t["bytes"]])
            for t in header["tensors"]}


def main():
    newer_than = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    version, tensors = latest(sys.argv[1], newer_than)
    codes = {"float32": "f", "float64": "d", "int32": "i", "int64": "q"}
    out = {}
    for name, (dtype, shape, raw) in tensors.items():
        values = array.array(codes[dtype], raw).tolist() if dtype in codes else None
        out[name] = {"dtype": dtype, "shape": shape, "values": values}
    print(json.dumps({"version": version, "tensors": out}, sort_keys=True))


if __name__ == "__main__":
    main()
