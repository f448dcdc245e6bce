"""Real image and audio files made in the test: a PNG written by hand with ``zlib``, other image
formats encoded by Pillow (installed with matplotlib), WAV by the stdlib's ``wave``, MP3 frames
written by hand."""

from __future__ import annotations

import io
import random
import struct
import wave
import zlib

from PIL import Image


def png(width: int, height: int, noise: bool = False, seed: int = 0) -> bytes:
    """A valid RGB PNG: signature, IHDR, IDAT (zlib), IEND."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data))

    rng = random.Random(seed)
    row = width * 3
    raw = b"".join(
        b"\x00" + (rng.randbytes(row) if noise else bytes(row)) for _ in range(height)
    )
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 1))
            + chunk(b"IEND", b""))


def pillow(fmt: str, width: int, height: int, **kw: object) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 60)).save(out, fmt, **kw)
    return out.getvalue()


def wav(seconds: float, rate: int = 16_000, channels: int = 1, extra: bytes = b"") -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(bytes(int(seconds * rate) * 2 * channels))
    data = out.getvalue()
    if extra:  # a LIST chunk before "data", as editors write
        data = (data[:36] + b"LIST" + struct.pack("<I", len(extra)) + extra + data[36:])
        data = data[:4] + struct.pack("<I", len(data) - 8) + data[8:]
    return data


def mp3(frames: int, xing: bool = False, id3: bool = False) -> bytes:
    """MPEG-1 layer III, 128 kbit/s, 44.1 kHz, stereo: 417-byte frames of silence."""
    header = b"\xff\xfb\x90\x00"
    frame = header + bytes(413)
    body = frame * frames
    if xing:  # an Info tag in a first frame of its own, saying how many frames follow
        tag = b"Info" + struct.pack(">II", 1, frames)
        first = header + bytes(32) + tag
        body = first + bytes(417 - len(first)) + body
    if id3:
        tag_body = b"TIT2" + struct.pack(">I", 6) + b"\x00\x00\x00title" + bytes(500)
        body = b"ID3\x04\x00\x00" + bytes((0, 0, len(tag_body) >> 7, len(tag_body) & 0x7F)) \
            + tag_body + body
    return body
