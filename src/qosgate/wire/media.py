"""Sizes of images and lengths of audio read from their headers, never by decoding them.

A vision model's prompt cost follows the image's pixel dimensions and an audio model's the
clip's duration; both are written in the first bytes of the file (or, for JPEG, in a frame
header after the metadata segments, which are skipped by their lengths). The payload arrives as
base64 inside a ``data:`` URL: ``B64`` reads any byte range of it by decoding only the few
base64 characters that cover the range (4 characters are 3 bytes), so a 600 KB image costs a
few hundred decoded bytes. Everything here is pure: bytes in, numbers (or None) out.
"""

from __future__ import annotations

import binascii
import struct
from collections.abc import Callable

# a reader: (offset, n) -> up to n bytes from offset (fewer at the end, b"" past it)
Read = Callable[[int, int], bytes]

_MAX_JPEG_SEGMENTS = 64  # metadata segments skipped before giving up on finding the frame
_MAX_WAV_CHUNKS = 32
_MAX_MP3_SCAN = 4096  # bytes searched for the first frame header after an ID3 tag


class B64:
    """Random access to the bytes of a base64 text (no line breaks), decoding only what is
    read. ``size`` is the decoded length, known from the text's length."""

    __slots__ = ("size", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        n = len(text)
        pad = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
        self.size = n // 4 * 3 - pad if n % 4 == 0 else n * 3 // 4

    def read(self, offset: int, n: int) -> bytes:
        if offset < 0 or n <= 0 or offset >= self.size:
            return b""
        end = min(offset + n, self.size)
        first, last = offset // 3, (end + 2) // 3  # 3-byte groups covering the range
        chunk = self.text[first * 4 : last * 4]
        if len(chunk) % 4:
            chunk += "=" * (-len(chunk) % 4)
        try:
            raw = binascii.a2b_base64(chunk, strict_mode=True)
        except (binascii.Error, ValueError):
            return b""
        skip = offset - first * 3
        return raw[skip : skip + end - offset]


def bytes_reader(data: bytes) -> Read:
    """A reader over bytes in memory (tests, or a payload already decoded)."""
    return lambda offset, n: data[offset : offset + n] if offset >= 0 else b""


# ---------------------------------------------------------------------- images
def image_size(read: Read) -> tuple[int, int] | None:
    """(width, height) of a PNG, JPEG, GIF or WebP image from its header; None for another
    format or a header that does not make sense."""
    head = read(0, 32)
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        size = _png(head)
    elif head.startswith(b"\xff\xd8"):
        size = _jpeg(read)
    elif head[:6] in (b"GIF87a", b"GIF89a"):
        size = struct.unpack("<HH", head[6:10]) if len(head) >= 10 else None
    elif head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        size = _webp(head)
    else:
        return None
    if size is None or size[0] <= 0 or size[1] <= 0:
        return None
    return size[0], size[1]


def _png(head: bytes) -> tuple[int, int] | None:
    # the first chunk is IHDR: length, type, then width and height (big-endian)
    if len(head) < 24 or head[12:16] != b"IHDR":
        return None
    w, h = struct.unpack(">II", head[16:24])
    return w, h


# SOFn markers carry the frame size; C4 (DHT), C8 (JPG) and CC (DAC) share the range but do not
_SOF = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))
# markers that stand alone, without a length: TEM, RSTn, SOI, EOI
_STANDALONE = frozenset((0x01, *range(0xD0, 0xDA)))


def _jpeg(read: Read) -> tuple[int, int] | None:
    pos = 2
    for _ in range(_MAX_JPEG_SEGMENTS):
        seg = read(pos, 9)
        if len(seg) < 4 or seg[0] != 0xFF:
            return None
        marker = seg[1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        if marker == 0xDA:  # start of scan: the frame header comes before it, so none
            return None
        if marker in _SOF:
            if len(seg) < 9:
                return None
            h, w = struct.unpack(">HH", seg[5:9])
            return w, h
        (length,) = struct.unpack(">H", seg[2:4])
        if length < 2:
            return None
        pos += 2 + length
    return None


def _webp(head: bytes) -> tuple[int, int] | None:
    kind, data = head[12:16], head[20:]
    if kind == b"VP8X" and len(data) >= 10:
        w = int.from_bytes(data[4:7], "little") + 1
        h = int.from_bytes(data[7:10], "little") + 1
        return w, h
    if kind == b"VP8 " and len(data) >= 10 and data[3:6] == b"\x9d\x01\x2a":
        w, h = struct.unpack("<HH", data[6:10])
        return w & 0x3FFF, h & 0x3FFF
    if kind == b"VP8L" and len(data) >= 5 and data[0] == 0x2F:
        bits = int.from_bytes(data[1:5], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


# ---------------------------------------------------------------------- audio
def audio_seconds(read: Read, size: int) -> float | None:
    """The duration of a WAV or MP3 clip of ``size`` bytes from its headers; None for another
    format or headers that do not make sense."""
    head = read(0, 12)
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return _wav(read, size)
    return _mp3(read, size)


def _wav(read: Read, size: int) -> float | None:
    pos = 12
    byte_rate = 0
    for _ in range(_MAX_WAV_CHUNKS):
        hdr = read(pos, 20)
        if len(hdr) < 8:
            return None
        kind = hdr[:4]
        length = int.from_bytes(hdr[4:8], "little")
        if kind == b"fmt ":
            # format, channels, sample rate, then the byte rate
            if len(hdr) < 20:
                return None
            byte_rate = int.from_bytes(hdr[16:20], "little")
        elif kind == b"data":
            if byte_rate <= 0:
                return None
            # a streamed WAV may leave the length unset (0 or all ones): the rest of the file
            available = size - pos - 8
            if length == 0 or length == 0xFFFFFFFF or length > available:
                length = max(0, available)
            return length / byte_rate
        pos += 8 + length + (length & 1)  # chunks are padded to an even length
    return None


# MPEG audio frame header tables: [version][index] (version: 3 = MPEG-1, 2 = MPEG-2, 0 = 2.5)
_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}
# kbit/s by (MPEG-1?, layer) for bitrate index 1..14
_BITRATES = {
    (True, 1): (32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 3): (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 1): (32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_BITRATES[(False, 3)] = _BITRATES[(False, 2)]


def _mp3(read: Read, size: int) -> float | None:
    start = 0
    tag = read(0, 10)
    if tag[:3] == b"ID3" and len(tag) == 10:
        synchsafe = tag[6:10]
        if any(b & 0x80 for b in synchsafe):
            return None
        body = 0
        for b in synchsafe:  # 7 bits a byte
            body = body << 7 | b
        start = 10 + body + (10 if tag[5] & 0x10 else 0)  # footer flag
    window = read(start, _MAX_MP3_SCAN)
    at = window.find(b"\xff")
    while 0 <= at <= len(window) - 4:
        frame = _frame(window[at : at + 4])
        if frame is not None:
            return _mp3_duration(read, size, start + at, *frame)
        at = window.find(b"\xff", at + 1)
    return None


def _frame(h: bytes) -> tuple[int, int, int, bool, int] | None:
    """(bit rate in bit/s, sample rate, samples per frame, MPEG-1?, channel mode) of a frame
    header; None if these four bytes are not one."""
    if h[0] != 0xFF or h[1] & 0xE0 != 0xE0:
        return None
    version = (h[1] >> 3) & 3
    layer = 4 - ((h[1] >> 1) & 3)  # bits 01 = layer III ... 11 = layer I
    rate_i, bit_i = (h[2] >> 2) & 3, h[2] >> 4
    if version == 1 or layer == 4 or rate_i == 3 or bit_i in (0, 15):
        return None
    mpeg1 = version == 3
    rate = _RATES[version][rate_i]
    bitrate = _BITRATES[(mpeg1, layer)][bit_i - 1] * 1000
    samples = 384 if layer == 1 else 1152 if layer == 2 or mpeg1 else 576
    return bitrate, rate, samples, mpeg1, h[3] >> 6


def _mp3_duration(
    read: Read, size: int, at: int, bitrate: int, rate: int, samples: int, mpeg1: bool,
    mode: int,
) -> float:
    """From a VBR header's frame count (Xing/Info or VBRI) if the first frame has one, else
    from the size at the first frame's constant bit rate."""
    mono = mode == 3
    side = (17 if mono else 32) if mpeg1 else (9 if mono else 17)
    xing = read(at + 4 + side, 12)
    if xing[:4] in (b"Xing", b"Info") and len(xing) == 12 and xing[7] & 1:
        frames = int.from_bytes(xing[8:12], "big")
        return frames * samples / rate
    vbri = read(at + 36, 18)
    if vbri[:4] == b"VBRI" and len(vbri) == 18:
        frames = int.from_bytes(vbri[14:18], "big")
        return frames * samples / rate
    return max(0, size - at) * 8 / bitrate
