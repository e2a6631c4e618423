"""A small MessagePack writer that uses the smallest format for every value (section 3.2), as
the Rust SDK does, so that envelopes re-encode byte for byte. Reading uses ``msgpack``."""

from __future__ import annotations

import struct


class Writer:
    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def uint(self, n: int) -> None:
        b = self.buf
        if n < 0:
            raise ValueError(f"{n} is not an unsigned integer")
        if n < 0x80:
            b.append(n)
        elif n < 0x100:
            b += b"\xcc" + n.to_bytes(1, "big")
        elif n < 0x10000:
            b += b"\xcd" + n.to_bytes(2, "big")
        elif n < 0x100000000:
            b += b"\xce" + n.to_bytes(4, "big")
        elif n < 1 << 64:
            b += b"\xcf" + n.to_bytes(8, "big")
        else:
            raise ValueError(f"{n} does not fit 64 bits")

    def str(self, s: str) -> None:
        data = s.encode("utf-8")
        n = len(data)
        b = self.buf
        if n < 32:
            b.append(0xA0 | n)
        elif n < 0x100:
            b += b"\xd9" + n.to_bytes(1, "big")
        elif n < 0x10000:
            b += b"\xda" + n.to_bytes(2, "big")
        else:
            b += b"\xdb" + n.to_bytes(4, "big")
        b += data

    def bin(self, data: bytes) -> None:
        n = len(data)
        b = self.buf
        if n < 0x100:
            b += b"\xc4" + n.to_bytes(1, "big")
        elif n < 0x10000:
            b += b"\xc5" + n.to_bytes(2, "big")
        else:
            b += b"\xc6" + n.to_bytes(4, "big")
        b += data

    def array(self, n: int) -> None:
        b = self.buf
        if n < 16:
            b.append(0x90 | n)
        elif n < 0x10000:
            b += b"\xdc" + n.to_bytes(2, "big")
        else:
            b += b"\xdd" + n.to_bytes(4, "big")

    def map(self, n: int) -> None:
        b = self.buf
        if n < 16:
            b.append(0x80 | n)
        elif n < 0x10000:
            b += b"\xde" + n.to_bytes(2, "big")
        else:
            b += b"\xdf" + n.to_bytes(4, "big")

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
    writes it in JSON (``0.25``, ``0.0``, ``1e-7``); ``null`` when not finite."""
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
        out = f"{digits}e{point - 1}"
    else:
        out = f"{digits[0]}.{digits[1:]}e{point - 1}"
    return sign + out
