"""Who decodes data.images_on=disk's images (dev.decode_in): worker processes or threads.

Both hand out one handle per requested view, with a Future's done / result / exception / cancel
/ cancelled, and take it back with release(handle, copied) once its pixels have been used.

ProcessDecoder (processes, the default where the OS has memfd_create): worker processes
(data/decode_worker.py) decode into slots of one shared memory block, pinned on CUDA, so a slot
is copied to the GPU straight from where the worker wrote it. The training process only writes
and reads small pipe records, from its own thread: no thread of its own waits for the GIL, which
a training loop running Python hands over only every switch interval (decode_worker.py says why).
A slot goes back to the free list once the copy from it has run (the `copied` event).

ThreadDecoder (threads): a thread pool in the training process, each decode pinned on CUDA.
"""

from __future__ import annotations

import json
import mmap
import os
import select
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path

import torch

from gstrain.data.decode_worker import ERROR_USER, REQUEST, RESULT
from gstrain.errors import UserError

QUEUED, RUNNING, DONE, FAILED, CANCELLED = range(5)
_PAGE = mmap.PAGESIZE
_STOP_WAIT_S = 5.0  # a worker that has not exited this long after its pipe closed is killed
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder gstrain/ is in: the workers import it


def processes_available() -> bool:
    return hasattr(os, "memfd_create")


class ThreadDecoder:
    """decode(idx) on `workers` threads; its results are the handles' own tensors."""

    shares_memory = False

    def __init__(self, decode: Callable[[int], torch.Tensor], workers: int) -> None:
        self.decode = decode
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="gstrain-decode")

    def submit(self, idx: int, urgent: bool = False) -> Future[torch.Tensor]:
        return self.pool.submit(self.decode, idx)

    def wait(self, handle: Future[torch.Tensor]) -> None:
        futures_wait([handle])

    def release(self, handle: Future[torch.Tensor], copied: torch.cuda.Event | None) -> None:
        pass

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class Decoding:
    """One view's decode in a ProcessDecoder (the Future calls DiskStore makes)."""

    __slots__ = ("decoder", "idx", "slot", "state", "shape", "error")

    def __init__(self, decoder: ProcessDecoder, idx: int) -> None:
        self.decoder, self.idx = decoder, idx
        self.slot = -1
        self.state = QUEUED
        self.shape = (0, 0)
        self.error: UserError | None = None

    def done(self) -> bool:
        if self.state in (QUEUED, RUNNING):
            self.decoder.poll()
        return self.state in (DONE, FAILED)

    def cancelled(self) -> bool:
        return self.state == CANCELLED

    def cancel(self) -> bool:
        self.decoder.cancel(self)
        return True

    def exception(self) -> UserError | None:
        return self.error if self.done() else None

    def result(self) -> torch.Tensor:
        """[h, w, 3] uint8 in the handle's slot, valid until release()."""
        self.decoder.wait(self)
        if self.error is not None:
            raise self.error
        return self.decoder.pixels(self)


class ProcessDecoder:
    """`workers` decode processes for lazy views (their ImageRecipe), `slots` shared slots of the
    largest decoded view's size, pinned for asynchronous copies when `pin`."""

    shares_memory = True

    def __init__(self, recipes: Sequence, workers: int, slots: int, pin: bool) -> None:
        self.recipes = list(recipes)
        self.slot_bytes = -(-max(r.decoded_nbytes for r in self.recipes) // _PAGE) * _PAGE
        self.slots = max(1, slots)
        size = self.slots * self.slot_bytes
        self.arena_fd = os.memfd_create("gstrain-decode")
        os.ftruncate(self.arena_fd, size)
        self.arena = mmap.mmap(self.arena_fd, size)
        self.block = torch.frombuffer(self.arena, dtype=torch.uint8)
        self.pinned = pin and _register(self.block)
        self.free = deque(range(self.slots))
        self.cooling: deque[tuple[int, torch.cuda.Event | None]] = deque()  # slots whose copy may still run
        self.queue: deque[Decoding] = deque()
        self.running: dict[int, Decoding] = {}  # slot -> its decode
        self.buffer = b""
        self.ended = False  # the result pipe reached end of file
        self.closed = False
        request_read, self.request_fd = os.pipe()
        # a store dropped without close() (an error left the loop): end of file still stops its workers
        self.unclosed = weakref.finalize(self, os.close, self.request_fd)
        self.result_fd, result_write = os.pipe()
        os.set_blocking(self.result_fd, False)
        header = json.dumps({
            "arena_fd": self.arena_fd, "arena_bytes": size, "slot_bytes": self.slot_bytes,
            "request_fd": request_read, "result_fd": result_write,
            "views": [[str(r.file), list(r.target), None if r.composite_over is None else
                       [float(c) for c in r.composite_over]] for r in self.recipes],
        }).encode()  # fmt: skip
        # the header in memory of its own, which each worker reads at its offset 0 when it is up:
        # starting the workers waits for none of them
        header_fd = os.memfd_create("gstrain-decode-header")
        os.write(header_fd, header)
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p))
        self.workers: list[subprocess.Popen] = []
        try:
            for _ in range(max(1, workers)):
                self.workers.append(subprocess.Popen(
                    [sys.executable, "-m", "gstrain.data.decode_worker", str(header_fd), str(len(header))],
                    stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                    pass_fds=(self.arena_fd, header_fd, request_read, result_write),
                ))  # fmt: skip
        except OSError as exc:
            self.close()
            raise UserError(f"cannot start the image decode processes: {exc} "
                            "(dev.decode_in=threads avoids them)") from None
        finally:  # the workers hold these ends now; end of file on them then means the workers are gone
            os.close(header_fd)
            os.close(request_read)
            os.close(result_write)

    def submit(self, idx: int, urgent: bool = False) -> Decoding:
        handle = Decoding(self, idx)
        if urgent:
            self.queue.appendleft(handle)
        else:
            self.queue.append(handle)
        self._dispatch()
        return handle

    def pixels(self, handle: Decoding) -> torch.Tensor:
        h, w = handle.shape
        start = handle.slot * self.slot_bytes
        return self.block[start : start + h * w * 3].view(h, w, 3)

    def release(self, handle: Decoding, copied: torch.cuda.Event | None) -> None:
        """The handle's pixels are used (their copy enqueued before `copied`): its slot is free
        once that event has passed."""
        if handle.slot >= 0 and handle.state in (DONE, FAILED):
            self.cooling.append((handle.slot, copied))
            handle.slot = -1
            handle.state = CANCELLED

    def cancel(self, handle: Decoding) -> None:
        if handle.state == QUEUED:
            self.queue.remove(handle)
        elif handle.state in (DONE, FAILED):
            self.free.append(handle.slot)
            handle.slot = -1
        handle.state = CANCELLED  # a running decode's slot comes back with its result (poll)

    def poll(self) -> None:
        """Read the results the workers have written; start queued decodes in freed slots."""
        while not self.ended:
            try:
                chunk = os.read(self.result_fd, 1 << 16)
            except BlockingIOError:
                break
            self.buffer += chunk
            self.ended = not chunk  # end of file: every worker has exited
        while len(self.buffer) >= RESULT.size:
            idx, slot, status, h, w, length = RESULT.unpack_from(self.buffer)
            if len(self.buffer) < RESULT.size + length:
                break
            message = self.buffer[RESULT.size : RESULT.size + length].decode("utf-8", "replace")
            self.buffer = self.buffer[RESULT.size + length :]
            handle = self.running.pop(slot)
            if handle.state == CANCELLED:
                self.free.append(slot)
                continue
            handle.shape, handle.state = (h, w), DONE
            if status:
                handle.state = FAILED
                file = self.recipes[idx].file
                handle.error = UserError(message if status == ERROR_USER else f"cannot decode image {file}: {message}")
        self._dispatch()

    def wait(self, handle: Decoding) -> None:
        while not handle.done():
            if handle.state == QUEUED and not self.free:
                self._wait_for_a_slot()
                continue
            if self.ended or not select.select([self.result_fd], [], [], 1.0)[0]:
                self._check_workers()

    def _wait_for_a_slot(self) -> None:
        if not self.cooling:
            raise RuntimeError("every decode slot is held by a decoded image nobody took: the store's bound is wrong")
        slot, copied = self.cooling.popleft()
        if copied is not None:
            copied.synchronize()
        self.free.append(slot)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.cooling and (self.cooling[0][1] is None or self.cooling[0][1].query()):
            self.free.append(self.cooling.popleft()[0])
        requests = []
        while self.queue and self.free:
            handle = self.queue.popleft()
            handle.slot, handle.state = self.free.popleft(), RUNNING
            self.running[handle.slot] = handle
            requests.append(REQUEST.pack(handle.idx, handle.slot))
        if requests:
            try:
                os.write(self.request_fd, b"".join(requests))  # a few records: far under the pipe's buffer
            except BrokenPipeError:
                self._check_workers()
                raise

    def _check_workers(self) -> None:
        """UserError if a worker has exited (its decodes would never come back)."""
        for _ in range(50 if self.ended else 1):  # at end of file the exit codes follow within moments
            for worker in self.workers:
                code = worker.poll()
                if code is not None:
                    raise UserError(f"an image decode process exited with code {code} (out of memory?); "
                                    "dev.decode_in=threads decodes in the training process")  # fmt: skip
            if self.ended:
                time.sleep(0.01)
        if self.ended:
            raise UserError("the image decode processes closed their pipe; dev.decode_in=threads decodes in "
                            "the training process")  # fmt: skip

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.request_fd >= 0:
            self.unclosed.detach()
            os.close(self.request_fd)  # end of file: the workers exit
            self.request_fd = -1
        for worker in self.workers:
            try:
                worker.wait(_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        self.workers = []
        for _slot, copied in self.cooling:  # the copies must be done before their memory goes
            if copied is not None:
                copied.synchronize()
        self.cooling.clear()
        if self.result_fd >= 0:
            os.close(self.result_fd)
            self.result_fd = -1
        if self.pinned:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.block.data_ptr()))
            self.pinned = False
        del self.block
        try:
            self.arena.close()
        except BufferError:  # a caller still holds a slot's tensor: the memory goes with it
            pass
        os.close(self.arena_fd)


def _register(block: torch.Tensor) -> bool:
    """Pin the shared block (cudaHostRegister) so copies from it run asynchronously; False (copies
    then wait for the host) where CUDA refuses."""
    try:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(block.data_ptr(), block.numel(), 0))
    except RuntimeError:
        return False
    return True
