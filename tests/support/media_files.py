"""Image and audio files made in the test, by hand: a complete PNG (``zlib``), the headers of
JPEG, GIF, WebP and BMP files laid out as encoders write them (markers, chunks, the sizes where
decoders read them), WAV by the stdlib's ``wave``, MP3 frames. ``pillow`` encodes real files
with Pillow when it is installed (it comes with the ``plots`` extra), to check the readers on an
encoder's own output too."""

from __future__ import annotations

import io
import random
import struct
import wave
import zlib


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


def pillow(fmt: str, width: int, height: int, mode: str = "RGB", **kw: object) -> bytes:
    from PIL import Image  # the caller skips the test without it

    out = io.BytesIO()
    Image.new(mode, (width, height)).save(out, fmt, **kw)
    return out.getvalue()


def _segment(marker: int, data: bytes) -> bytes:
    return b"\xff" + bytes((marker,)) + struct.pack(">H", len(data) + 2) + data


def jpeg(width: int, height: int, progressive: bool = False, exif: int = 0) -> bytes:
    """A JPEG's markers in a baseline (SOF0) or progressive (SOF2) encoder's order: SOI, JFIF,
    an optional EXIF segment of ``exif`` bytes, a quantisation table, the frame header with the
    size, a Huffman table, the scan header, scan data, EOI."""
    app0 = _segment(0xE0, b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00")
    app1 = _segment(0xE1, b"Exif\x00\x00" + bytes(exif)) if exif else b""
    dqt = _segment(0xDB, b"\x00" + bytes(range(1, 65)))
    components = b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    sof = _segment(0xC2 if progressive else 0xC0,
                   struct.pack(">BHHB", 8, height, width, 3) + components)
    dht = _segment(0xC4, b"\x00" + bytes((0, 1, 5, 1, 1, 1, 1, 1, 1)) + bytes(7) + bytes(range(12)))
    sos = _segment(0xDA, b"\x03\x01\x00\x02\x11\x03\x11\x00\x3f\x00")
    return b"\xff\xd8" + app0 + app1 + dqt + sof + dht + sos + bytes(64) + b"\xff\xd9"


def gif(width: int, height: int) -> bytes:
    """A GIF89a header, logical screen and a 2-colour table, an image descriptor, a one-pixel
    LZW stream (clear, pixel, end) and the trailer."""
    screen = struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
    image = b"," + struct.pack("<HHHHB", 0, 0, width, height, 0) + b"\x02\x02\x44\x01\x00"
    return b"GIF89a" + screen + image + b";"


def _riff_webp(*chunks: bytes) -> bytes:
    body = b"WEBP" + b"".join(chunks)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _chunk(kind: bytes, data: bytes) -> bytes:
    return kind + struct.pack("<I", len(data)) + data + (b"\x00" if len(data) % 2 else b"")


def webp(width: int, height: int, kind: str = "VP8") -> bytes:
    """A WebP file: lossy (``VP8``: key-frame tag, start code, 14-bit sizes), lossless
    (``VP8L``: signature, sizes less one packed in 14 bits each) or extended (``VP8X``: the
    canvas size less one in 24 bits each, then a lossless bitstream)."""
    vp8l = _chunk(b"VP8L", b"\x2f" + struct.pack("<I", (width - 1) | (height - 1) << 14)
                  + bytes(8))
    if kind == "VP8L":
        return _riff_webp(vp8l)
    if kind == "VP8X":
        canvas = b"\x10\x00\x00\x00" + (width - 1).to_bytes(3, "little") \
            + (height - 1).to_bytes(3, "little")
        return _riff_webp(_chunk(b"VP8X", canvas), vp8l)
    frame = b"\x50\x02\x00" + b"\x9d\x01\x2a" + struct.pack("<HH", width, height) + bytes(20)
    return _riff_webp(_chunk(b"VP8 ", frame))


def bmp(width: int, height: int) -> bytes:
    """A BMP header (a format the gateway does not size)."""
    return b"BM" + struct.pack("<IHHIIiiHH", 54 + width * height * 3, 0, 0, 54, 40, width,
                               height, 1, 24) + bytes(24)


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
