"""Editing an HDF5 object header in place, for crafted files: HDF5 (libver latest) checks
each header chunk against Bob Jenkins' lookup3 hash, so an edit must recompute it."""

M = 0xFFFFFFFF


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & M


def _mix(a: int, b: int, c: int) -> tuple[int, int, int]:
    v = {"a": a, "b": b, "c": c}
    for x, y, k, w in (("a", "c", 4, "b"), ("b", "a", 6, "c"), ("c", "b", 8, "a"),
                       ("a", "c", 16, "b"), ("b", "a", 19, "c"), ("c", "b", 4, "a")):
        v[x] = ((v[x] - v[y]) & M) ^ _rot(v[y], k)
        v[y] = (v[y] + v[w]) & M
    return v["a"], v["b"], v["c"]


def _final(a: int, b: int, c: int) -> int:
    v = {"a": a, "b": b, "c": c}
    for x, y, k in (("c", "b", 14), ("a", "c", 11), ("b", "a", 25), ("c", "b", 16), ("a", "c", 4),
                    ("b", "a", 14), ("c", "b", 24)):
        v[x] = ((v[x] ^ v[y]) - _rot(v[y], k)) & M
    return v["c"]


def lookup3(data: bytes) -> int:
    """``H5_checksum_lookup3(data, len, 0)``: hashlittle with an initial value of 0."""
    n = len(data)
    a = b = c = (0xDEADBEEF + n) & M
    at = 0
    while True:
        x, y, z = (int.from_bytes((data[at:at + 12] + bytes(12))[4 * k:4 * k + 4], "little") for k in range(3))
        if n - at > 12:
            a, b, c = _mix((a + x) & M, (b + y) & M, (c + z) & M)
            at += 12
        elif n == at:
            return c
        else:
            return _final((a + x) & M, (b + y) & M, (c + z) & M)


def fix_header_checksum(buf: bytearray, at: int) -> None:
    """Recompute the checksum of the version 2 object header chunk that holds byte ``at``."""
    start = buf.rfind(b"OHDR", 0, at)
    flags, p = buf[start + 5], start + 6
    p += 16 if flags & 0x20 else 0  # times
    p += 4 if flags & 0x10 else 0  # attribute phase change values
    width = 1 << (flags & 3)
    end = p + width + int.from_bytes(buf[p:p + width], "little")
    assert start < at < end, (start, at, end)
    buf[end:end + 4] = lookup3(bytes(buf[start:end])).to_bytes(4, "little")
