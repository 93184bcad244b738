"""How the chaos fuzz breaks a message (``fuzz_messages.Fuzzer`` inherits these): field values replaced by
huge or negative ints, wrong types, NaN/inf, long strings or huge lists, fields added or dropped, non-string
keys (``_mutate``); and the raw-bytes kinds: random bytes, truncated, garbled, trailing bytes, msgpack bombs,
not a map (``_bytes_kind``).

A ``Mutations`` user provides ``self.rng`` (``random.Random``, the only source of randomness: same seed, same
mutations) and ``self._text(lo, hi)`` (a short random string).
"""
from __future__ import annotations

import copy
import math
import struct
from typing import Any

import msgpack

HUGE_INTS = [2**31, 2**32 + 7, 2**53 + 1, 10**15, 2**63 - 1, 2**63, 2**64 - 1]
NEGATIVE_INTS = [-1, -7, -2**31, -2**53, -2**63]
ODD_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324, -1.5]
WRONG_TYPES: list[Any] = ["", "x", "1", [], [1, 2], [["a"]], {}, {"a": 1}, {"": None}, True, False, None, 0.5,
                          b"", b"\x00\xff", 0]


class Mutations:
    def _long_string(self) -> str:
        n = 1_000_000 if self.rng.random() < 0.02 else self.rng.choice([300, 5000, 70_000])
        unit = self.rng.choice(["a", "é", "中", "🙂", ".", "*", ">", " ", "\x00", "x.y ", "\u202e"])
        return unit * (n // len(unit))

    def _huge_list(self) -> list:
        n = 1_000_001 if self.rng.random() < 0.02 else self.rng.choice([1000, 10_000, 100_000])
        item = self.rng.choice([0, 1, 2**64 - 1, -1, "a", None, 0.5, [], {}])
        if n == 1_000_001 and item not in (0, 1, None):  # keep the biggest ones to a few MB
            item = 0
        if isinstance(item, int) and item == 2**64 - 1 and n > 100_000:
            n = 100_000
        return [item] * n

    def _odd_value(self) -> Any:
        r = self.rng.random()
        if r < 0.2:
            return self.rng.choice(HUGE_INTS)
        if r < 0.35:
            return self.rng.choice(NEGATIVE_INTS)
        if r < 0.55:
            return copy.deepcopy(self.rng.choice(WRONG_TYPES))  # never share (and later mutate) the pool's objects
        if r < 0.7:
            return self.rng.choice(ODD_FLOATS)
        if r < 0.8:
            return self._long_string()
        if r < 0.87:
            return self._huge_list()
        if r < 0.95:
            return {self._text(1, 8): copy.deepcopy(self.rng.choice(WRONG_TYPES + HUGE_INTS))
                    for _ in range(self.rng.randint(1, 4))}
        return [copy.deepcopy(self.rng.choice(WRONG_TYPES + HUGE_INTS + NEGATIVE_INTS))
                for _ in range(self.rng.randint(1, 8))]

    def _mutate(self, d: dict[str, Any]) -> None:
        rng = self.rng
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            op = rng.random()
            nested = [k for k, v in d.items()
                      if isinstance(v, dict) or (isinstance(v, list) and 0 < len(v) <= 10 and isinstance(v[0], dict))]
            if op < 0.55 and d:
                d[rng.choice(sorted(d, key=repr))] = self._odd_value()
            elif op < 0.7 and nested:
                key = rng.choice(sorted(nested, key=repr))
                inner = d[key] if isinstance(d[key], dict) else rng.choice([x for x in d[key] if isinstance(x, dict)])
                if inner and rng.random() < 0.8:
                    inner[rng.choice(sorted(inner, key=repr))] = self._odd_value()
                else:
                    key = rng.choice(["extra", "i", "max_tokens", "subject", "shape", "segment", "role"])
                    inner[key] = self._odd_value()
            elif op < 0.8:
                key = rng.choice(["extra", "v2", "request_id ", "__class__", "_".join("abc"), "é", "x" * 300])
                d[key] = self._odd_value()
            elif op < 0.88 and d:
                del d[rng.choice(sorted(d, key=repr))]
            elif op < 0.94:
                d[rng.choice([1, -1, b"bin", 2.5])] = "non-str key"  # strict_map_key rejects
            else:
                for k in sorted(d, key=repr):  # every int field at once
                    if isinstance(d[k], int) and not isinstance(d[k], bool):
                        d[k] = rng.choice(HUGE_INTS + NEGATIVE_INTS)

    def _bytes_kind(self, valid: bytes) -> tuple[bytes, str]:
        rng = self.rng
        r = rng.random()
        if r < 0.2:
            return rng.randbytes(rng.choice([0, 1, 2, 7, 64, 1000, 70_000])), "random_bytes"
        if r < 0.4:
            return valid[:rng.randrange(max(1, len(valid)))], "truncated"
        if r < 0.6:
            b = bytearray(valid)
            for _ in range(rng.randint(1, 8)):
                if b:
                    b[rng.randrange(len(b))] = rng.randrange(256)
            return bytes(b), "garbled"
        if r < 0.7:
            return valid + rng.choice([b"\x00", b"\xc1", msgpack.packb({"v": 1}), valid]), "trailing"
        if r < 0.85:
            bombs = [b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xffabc",
                     b"\xc6\xff\xff\xff\xff", b"\x91" * 100_000 + b"\xc0", b"\x81\xa1v" * 5000 + b"\x01",
                     b"\xd4\x01\x00", b"\xd6\xff" + struct.pack(">I", 0), b"\xc7\x00\x05", b"\xc1",
                     b"\x81\x01\x02", b"\x81\xc0\x01", b"\xde\x00\x01\xa1v\x01"]
            return rng.choice(bombs), "msgpack_bombs"
        return msgpack.packb(rng.choice([None, 1, -1, "GenerateRequest", [1, 2], b"\x00", 1.5, True, []]),
                             use_bin_type=True), "not_a_map"
