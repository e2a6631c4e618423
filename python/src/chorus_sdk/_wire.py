"""A small MessagePack writer that uses the smallest format for every value (section 3.2), as
the Rust SDK does, so that envelopes re-encode byte for byte. Reading uses ``msgpack``."""

from __future__ import annotations

import struct


def _header(b: bytearray, n: int, small: int | None, small_limit: int, formats: bytes) -> None:
    """A length header: the fix form below ``small_limit`` (when the family has one), else the
    8-, 16- or 32-bit form whose first bytes ``formats`` lists (a zero where there is none)."""
    if small is not None and n < small_limit:
        b.append(small | n)
    elif formats[0] and n < 0x100:
        b += bytes((formats[0], n))
    elif n < 0x10000:
        b += bytes((formats[1],)) + n.to_bytes(2, "big")
    else:
        b += bytes((formats[2],)) + n.to_bytes(4, "big")


def put_uint(b: bytearray, n: int) -> None:
    """An unsigned integer in its smallest format."""
    if 0 <= n < 0x80:
        b.append(n)
    elif 0 <= n < 0x100:
        b += b"\xcc" + n.to_bytes(1, "big")
    elif 0 <= n < 0x10000:
        b += b"\xcd" + n.to_bytes(2, "big")
    elif 0 <= n < 0x100000000:
        b += b"\xce" + n.to_bytes(4, "big")
    elif 0 <= n < 1 << 64:
        b += b"\xcf" + n.to_bytes(8, "big")
    else:
        raise ValueError(f"{n} is not an unsigned 64-bit integer")


def put_str(b: bytearray, s: str) -> None:
    data = s.encode("utf-8")
    _header(b, len(data), 0xA0, 32, b"\xd9\xda\xdb")
    b += data


def put_bin(b: bytearray, data: bytes) -> None:
    _header(b, len(data), None, 0, b"\xc4\xc5\xc6")
    b += data


def put_array(b: bytearray, n: int) -> None:
    _header(b, n, 0x90, 16, b"\x00\xdc\xdd")


def put_map(b: bytearray, n: int) -> None:
    _header(b, n, 0x80, 16, b"\x00\xde\xdf")


class Writer:
    """A buffer with the writers above as methods."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def uint(self, n: int) -> None:
        put_uint(self.buf, n)

    def str(self, s: str) -> None:
        put_str(self.buf, s)

    def bin(self, data: bytes) -> None:
        put_bin(self.buf, data)

    def array(self, n: int) -> None:
        put_array(self.buf, n)

    def map(self, n: int) -> None:
        put_map(self.buf, n)

    def f32(self, x: float) -> None:
        self.buf += b"\xca" + struct.pack(">f", x)

    def f64(self, x: float) -> None:
        self.buf += b"\xcb" + struct.pack(">d", x)

    def nil(self) -> None:
        self.buf.append(0xC0)

    def bool(self, v: bool) -> None:
        self.buf.append(0xC3 if v else 0xC2)


def to_f32(x: float) -> float:
    """``x`` rounded to the nearest 32-bit float."""
    return float(struct.unpack(">f", struct.pack(">f", x))[0])


def f32_text(x: float) -> str:
    """The shortest decimal that reads back as the same 32-bit float, written as the Rust SDK
    writes it in JSON (``0.25``, ``0.0``, ``1e-7``, ``1e+14``; PROTOCOL.md section 3.2's rule);
    ``null`` when not finite."""
    if x != x or x in (float("inf"), float("-inf")):
        return "null"
    x = to_f32(x)
    if x == 0:
        return "-0.0" if struct.pack(">f", x)[0] & 0x80 else "0.0"
    for precision in range(1, 10):
        text = f"{abs(x):.{precision - 1}e}"
        if to_f32(float(text)) == abs(x):
            break
    mantissa, exp_text = text.split("e")
    digits = mantissa.replace(".", "").rstrip("0") or "0"
    exponent = int(exp_text)
    sign = "-" if x < 0 else ""
    # The decimal point sits after `point` digits (ryu's layout for f32).
    length = len(digits)
    point = exponent + 1
    if 0 <= point - length and point <= 13:
        out = digits + "0" * (point - length) + ".0"
    elif 0 < point <= 13:
        out = digits[:point] + "." + digits[point:]
    elif -6 < point <= 0:
        out = "0." + "0" * (-point) + digits
    elif length == 1:
        out = f"{digits}e{point - 1:+d}"
    else:
        out = f"{digits[0]}.{digits[1:]}e{point - 1:+d}"
    return sign + out
