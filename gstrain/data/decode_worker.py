"""A decode worker process of data.images_on=disk (data/decoders.py's ProcessDecoder starts them):
decodes the views it is asked for into slots of a shared memory block, with PIL and numpy only.

Why a process: in the training process a decode thread needs the GIL several times an image (the
file read, each decode call, the pixel copy), and a training loop that runs Python hands the GIL
over only every switch interval (5 ms), so threads there decoded 10x slower than alone
(bench/NOTES.md). A worker process has a GIL of its own.

Protocol (all pipes; the training process's ProcessDecoder is the other end):
- argv: a descriptor (memory of its own) and the length of one JSON object there: {"arena_fd",
  "arena_bytes", "slot_bytes", "request_fd", "result_fd", "views": [[file, [w, h],
  composite_over or null], ...]}.
- request_fd (shared by every worker, so an idle worker takes the next request): records of
  REQUEST = (view index, slot); end of file: exit.
- result_fd (shared): records of RESULT = (view index, slot, status, height, width, message
  length) and the message, written whole (under PIPE_BUF, so records never interleave). status 0:
  the slot holds the [height, width, 3] pixels; ERROR_USER: the message is the one-line error the
  training process raises; ERROR_OTHER: an unexpected failure, the message names it.
"""

from __future__ import annotations

import signal

if __name__ == "__main__":
    # before the imports below: the training process saves on Ctrl-C and SIGTERM, then closes the
    # pipes, and end of file on the request pipe is what stops a worker (it starts in a session of
    # its own, so a terminal's Ctrl-C does not reach it; this covers a signal sent to it anyway)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

import json  # noqa: E402
import mmap  # noqa: E402
import os  # noqa: E402
import struct  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from gstrain.data.decode import decoded_array  # noqa: E402
from gstrain.errors import UserError  # noqa: E402

REQUEST = struct.Struct("<II")
RESULT = struct.Struct("<IIIIII")
ERROR_USER, ERROR_OTHER = 1, 2
MESSAGE_BYTES = 3000  # a result record stays under PIPE_BUF (4096 on Linux): one atomic write


def result_record(idx: int, slot: int, status: int, shape: tuple[int, int], message: str = "") -> bytes:
    text = message.encode("utf-8", "replace")[:MESSAGE_BYTES]
    return RESULT.pack(idx, slot, status, shape[0], shape[1], len(text)) + text


def _read_exactly(fd: int, size: int) -> bytes:
    """`size` bytes from a pipe, or b"" at end of file (a record is written whole, so a read of
    one record's size returns all of it or, at the end, nothing)."""
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


def serve(header: dict) -> None:
    slot_bytes = int(header["slot_bytes"])
    arena = mmap.mmap(int(header["arena_fd"]), int(header["arena_bytes"]))
    views = [(Path(f), (int(t[0]), int(t[1])), None if o is None else np.asarray(o, dtype=np.float64))
             for f, t, o in header["views"]]  # fmt: skip
    requests, results = int(header["request_fd"]), int(header["result_fd"])
    while True:
        record = _read_exactly(requests, REQUEST.size)
        if not record:
            return
        idx, slot = REQUEST.unpack(record)
        file, target, over = views[idx]
        try:
            pixels = decoded_array(file, target, over)
            if pixels.nbytes > slot_bytes:
                raise UserError(f"image {file} decoded to {pixels.shape[1]}x{pixels.shape[0]}, larger than its "
                                f"header said ({target[0]}x{target[1]})")  # fmt: skip
            np.frombuffer(arena, np.uint8, pixels.nbytes, slot * slot_bytes)[:] = pixels.reshape(-1)
            out = result_record(idx, slot, 0, pixels.shape[:2])
        except UserError as exc:
            out = result_record(idx, slot, ERROR_USER, (0, 0), str(exc))
        except Exception as exc:  # noqa: BLE001  reported to the training process, which raises it
            out = result_record(idx, slot, ERROR_OTHER, (0, 0), f"{type(exc).__name__}: {exc}")
        os.write(results, out)


def main() -> int:
    Image.preinit()  # PIL's common format plugins, imported while the training process starts up
    header_fd, size = int(sys.argv[1]), int(sys.argv[2])
    header = b""
    while len(header) < size:  # pread: the workers share the descriptor's offset, so none moves it
        header += os.pread(header_fd, size - len(header), len(header))
    os.close(header_fd)
    serve(json.loads(header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
