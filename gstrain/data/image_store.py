"""Where the training images live while a run trains (data.images_on), behind one small interface:

    store.get(idx)        -> view idx's image, [H, W, 3] uint8 on the training device
    store.prefetch(upcoming) the indices the sampler will draw next (ViewSampler.peek), in order
    store.shape(idx)      -> (H, W, 3) without fetching anything
    store.note()          -> one line when training waited on the images, else None
    store.close()

gpu:  every image decoded at start-up and kept on the device (uint8, a quarter of float32).
host: decoded at start-up into (pinned, on CUDA) host memory; each step's image is copied on a side
      stream one step ahead, and the step's stream waits for that copy only.
disk: nothing decoded at start-up (a lazy scene: gstrain/data/images.py); a small pool of worker
      threads decodes the sampler's next images into a bounded queue. A step whose image is not
      decoded yet waits for it, and the store counts how often and how long ("data-bound").
auto: the first of gpu, host, disk that the images fit in (choose_images_on), said in one line.

A lazy view of a distorted camera is decoded as it is in the file (resized, still distorted) and
undistorted on the training device by its map (data/undistort.py): gpu after the copy at start-up,
host and disk after each copy, by the same kernels, so every store gives the same bytes on a device.
Host memory and the disk queue hold the distorted decodes (their own size: decoded_shape).

get() of the index the last few get() calls returned gives the same tensor again (a step reads
its target again for the train PSNR), without a second copy or decode.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NoReturn, Protocol

import torch

from gstrain.data.decoders import ProcessDecoder, ThreadDecoder, processes_available
from gstrain.data.images import LazyView, decoded_pixels, view_map, view_shape
from gstrain.data.images_on import DEVICE_SHARE as DEVICE_SHARE  # re-exported: the stores' callers read them here
from gstrain.data.images_on import HOST_SHARE as HOST_SHARE
from gstrain.data.images_on import check_images_on as check_images_on
from gstrain.data.images_on import choose_images_on as choose_images_on
from gstrain.data.images_on import resolve_images_on
from gstrain.data.images_on import scene_is_lazy as scene_is_lazy
from gstrain.data.scene import View
from gstrain.data.undistort import DenseMaps, UndistortMap, pin_maps, remap

# Decode threads follow the machine's cores (PIL decodes and resizes without the GIL): a 1080p JPEG
# takes a thread about 38 ms (eight decoded 210 a second on the H200 machine's 16 cores), so four
# threads could not keep up with a 13 ms step
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 4)
DISK_WORKERS = max(4, min(16, _CORES - 2))  # images_on=disk; two cores stay with the loop and the copies
DEPTH_PER_WORKER = 2  # images decoded ahead at most, per worker (the queue's memory is that many images)
START_WORKERS = max(4, min(32, _CORES))  # decode threads at start-up (gpu, host)


class ImageStore(Protocol):
    where: str
    lookahead: int  # how many upcoming indices prefetch() wants

    def __len__(self) -> int: ...
    def shape(self, idx: int) -> tuple[int, int, int]: ...
    def get(self, idx: int) -> torch.Tensor: ...
    def prefetch(self, upcoming: Sequence[int]) -> None: ...
    def note(self) -> str | None: ...
    def close(self) -> None: ...


def decode_all(views: Sequence[View], pin: bool = False, workers: int = START_WORKERS) -> list[torch.Tensor]:
    """Every view's image ([H, W, 3] uint8, CPU), decoded in parallel (lazy views decode here);
    pin: into pinned memory, each as it is decoded (host memory never holds two copies of all)."""
    return list(_decode_each(views, lambda view: view.image, pin, workers))


def _decode_each(views: Sequence[View], read: Callable[[View], torch.Tensor], pin: bool = False,
                 workers: int = START_WORKERS) -> Iterator[torch.Tensor]:
    """read(view) for every view, in order, `workers` at a time (PIL decodes without the GIL)."""
    if not views:
        return

    def one(view: View) -> torch.Tensor:
        return read(view).pin_memory() if pin else read(view)

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(views)))) as pool:
        yield from pool.map(one, views)


class _Recent:
    """The last few images get() returned, so a second read of a step's image costs nothing; and
    those the sampler draws again within the look-ahead (the end of one pass and the start of the
    next share views), which would otherwise be fetched again with only a step or two to spare.
    At most `keep` images and the look-ahead's are held."""

    def __init__(self, keep: int) -> None:
        self.keep = max(1, keep)
        self.items: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.upcoming: set[int] = set()

    def find(self, idx: int) -> torch.Tensor | None:
        image = self.items.get(idx)
        if image is not None:
            self.items.move_to_end(idx)  # returned again: among the step's own images
        return image

    def add(self, idx: int, image: torch.Tensor) -> torch.Tensor:
        self.items[idx] = image
        self.items.move_to_end(idx)
        self._trim()
        return image

    def expect(self, upcoming: Sequence[int]) -> None:
        """The indices prefetch() was given: held images outside them go, but the last `keep` returned."""
        self.upcoming = set(upcoming)
        self._trim()

    def _trim(self) -> None:
        older = list(self.items)[: len(self.items) - self.keep]
        for idx in older:
            if idx not in self.upcoming:
                del self.items[idx]


class _Base:
    where = ""

    def __init__(self, views: Sequence[View], device: torch.device, per_step: int, fused_remap: bool) -> None:
        self.shapes = [view_shape(v) for v in views]
        self.device = device
        self.per_step = max(1, per_step)  # views a step draws (train.batch_size)
        self.lookahead = self.per_step  # one step ahead
        self.recent = _Recent(self.per_step)
        self.cuda = device.type == "cuda"
        # each view's undistortion (None: decoded_pixels is its image); pinned on CUDA for async copies
        maps = [view_map(v) for v in views]
        self.maps: list[UndistortMap | None] = pin_maps(maps) if self.cuda else maps
        self.stream = torch.cuda.Stream(device) if self.cuda else None  # copies beside the step
        self.fused_remap = fused_remap and self.cuda  # dev.fused_remap: one kernel, no dense maps
        self.dense = DenseMaps()  # decode threads finish on the CPU: it locks

    def _finish(self, idx: int, decoded: torch.Tensor) -> torch.Tensor:
        """decoded_pixels of view idx, already on its device, as the view's image there."""
        undistort = self.maps[idx]
        if undistort is None:
            return decoded
        if self.fused_remap:
            return remap(decoded, undistort, fused=True)
        return remap(decoded, undistort, self.dense.get(undistort, decoded.device))

    def _upload(self, idx: int, decoded: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """View idx's image from its decoded_pixels (pinned on CUDA): copied and undistorted on the
        side stream, with the event the step waits for (_ready); on the CPU, undistorted here."""
        if self.stream is None:
            return self._finish(idx, decoded), None
        with torch.cuda.stream(self.stream):
            image = self._finish(idx, decoded.to(self.device, non_blocking=True))
            done = torch.cuda.Event()
            done.record(self.stream)
        return image, done

    def _ready(self, image: torch.Tensor, done: torch.cuda.Event | None) -> torch.Tensor:
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)  # the step waits for its copy on the GPU, not on the host
            image.record_stream(current)  # its memory is not reused before the step is done with it
        return image

    def __len__(self) -> int:
        return len(self.shapes)

    def shape(self, idx: int) -> tuple[int, int, int]:
        return self.shapes[idx]

    def note(self) -> str | None:
        return None

    def close(self) -> None:
        self.recent.items.clear()


class ResidentStore(_Base):
    """images_on=gpu: every image on the training device, as uint8."""

    where = "gpu"

    def __init__(self, views: Sequence[View], device: torch.device, per_step: int = 1,
                 fused_remap: bool = True) -> None:  # fmt: skip
        super().__init__(views, device, per_step, fused_remap)
        self.images = [self._finish(idx, image.to(device))
                       for idx, image in enumerate(_decode_each(views, decoded_pixels))]

    def get(self, idx: int) -> torch.Tensor:
        return self.images[idx]

    def prefetch(self, upcoming: Sequence[int]) -> None:
        pass


class HostStore(_Base):
    """images_on=host: decoded in host memory, pinned on CUDA; copied on a side stream ahead."""

    where = "host"

    def __init__(self, views: Sequence[View], device: torch.device, per_step: int = 1,
                 fused_remap: bool = True) -> None:  # fmt: skip
        super().__init__(views, device, per_step, fused_remap)
        self.host = list(_decode_each(views, decoded_pixels, pin=self.cuda))  # not undistorted yet
        self.inflight: OrderedDict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = OrderedDict()
        self.missed = 0  # gets whose copy had not been started ahead

    def _start(self, idx: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        return self._upload(idx, self.host[idx])

    def prefetch(self, upcoming: Sequence[int]) -> None:
        self.recent.expect(upcoming[: self.lookahead])
        for idx in upcoming[: self.lookahead]:
            if idx not in self.inflight and idx not in self.recent.items:
                self.inflight[idx] = self._start(idx)
        while len(self.inflight) > 2 * self.lookahead:  # copies the sampler no longer wants (a resume)
            self.inflight.popitem(last=False)

    def get(self, idx: int) -> torch.Tensor:
        again = self.recent.find(idx)
        if again is not None:
            return again
        entry = self.inflight.pop(idx, None)
        if entry is None:
            self.missed += 1
            entry = self._start(idx)
        return self.recent.add(idx, self._ready(*entry))

    def close(self) -> None:
        super().close()
        self.inflight.clear()


class DiskStore(_Base):
    """images_on=disk: decoded by workers (data/decoders.py) in the sampler's order, a bounded
    queue ahead. decode_in (dev.decode_in): "processes" (lazy views, where the OS allows) or
    "threads" (always possible: any view)."""

    where = "disk"

    def __init__(self, views: Sequence[View], device: torch.device, per_step: int = 1, workers: int = DISK_WORKERS,
                 depth: int | None = None, decode_in: str = "processes", fused_remap: bool = True) -> None:  # fmt: skip
        super().__init__(views, device, per_step, fused_remap)
        self.views = list(views)
        depth = DEPTH_PER_WORKER * workers if depth is None else depth
        self.depth = self.lookahead = max(depth, self.per_step)
        self.decoder: ProcessDecoder | ThreadDecoder
        if decode_in == "processes" and self.views and processes_available() and all(
                isinstance(v, LazyView) for v in self.views):  # fmt: skip
            # a slot for every decode the store may hold: pending (2 * depth at most before the
            # stale ones are cancelled), staged and still copying (2 * per_step each)
            slots = 2 * self.depth + 4 * self.per_step
            recipes = [v.recipe for v in self.views]  # type: ignore[attr-defined]
            self.decoder = ProcessDecoder(recipes, min(workers, len(self.views)), slots, pin=self.cuda)
        else:
            self.decoder = ThreadDecoder(self._decode, workers)
        self.pending: OrderedDict[int, Any] = OrderedDict()  # idx -> its decode (a Future's calls)
        # on CUDA, the next step's images once decoded: copied and undistorted on the side stream
        # while this step runs (the step's stream only waits for them)
        self.staged: OrderedDict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = OrderedDict()
        self.gets = 0
        self.waits = 0  # gets that found their image not decoded yet
        self.unasked = 0  # gets of an image prefetch() had not been given
        self.waited_s = 0.0
        self.longest_s = 0.0
        self.wait_at: list[tuple[int, float]] = []  # (get number, seconds) of the first waits: when they came

    def _decode(self, idx: int) -> torch.Tensor:
        """A decode thread's work: decoded_pixels, undistorted on the CPU, pinned on CUDA."""
        image = decoded_pixels(self.views[idx])
        if not self.cuda:  # the device is this CPU: undistorted here, in the worker (torch frees the GIL)
            return self._finish(idx, image)
        # pinned, the copy to the device is asynchronous; torch keeps the block until it has run
        return image.pin_memory()

    def _take(self, idx: int, decoding: Any) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """View idx's image from its finished decode (raising its error): on CUDA copied on the
        side stream with the event the step waits for; the decode's memory then goes back."""
        pixels = decoding.result()
        if self.cuda:
            entry = self._upload(idx, pixels)
            self.decoder.release(decoding, entry[1])
            return entry
        if self.decoder.shares_memory:  # a process's slot: copied out before it is reused
            pixels = self._finish(idx, pixels.clone())
            self.decoder.release(decoding, None)
        return pixels, None

    def prefetch(self, upcoming: Sequence[int]) -> None:
        self.recent.expect(upcoming[: self.depth])
        for idx in upcoming[: self.depth]:
            if idx not in self.pending and idx not in self.staged and idx not in self.recent.items:
                self.pending[idx] = self.decoder.submit(idx)
        while len(self.pending) > 2 * self.depth:  # decodes the sampler no longer wants (a resume)
            _idx, stale = self.pending.popitem(last=False)
            stale.cancel()
        if self.stream is None:
            return
        for idx in upcoming[: self.per_step]:
            decoding = self.pending.get(idx)
            if decoding is None or not decoding.done() or decoding.cancelled() or decoding.exception() is not None:
                continue  # not decoded yet (get waits for it) or failed (get raises its error)
            del self.pending[idx]
            self.staged[idx] = self._take(idx, decoding)
        while len(self.staged) > 2 * self.per_step:  # images the sampler no longer wants (a resume)
            self.staged.popitem(last=False)

    def get(self, idx: int) -> torch.Tensor:
        again = self.recent.find(idx)
        if again is not None:
            return again
        self.gets += 1
        staged = self.staged.pop(idx, None)
        if staged is not None:
            return self.recent.add(idx, self._ready(*staged))
        decoding = self.pending.pop(idx, None)
        if decoding is None:  # not asked for ahead: first in line, a wait all the same
            self.unasked += 1
            decoding = self.decoder.submit(idx, urgent=True)
        if not decoding.done():
            start = time.perf_counter()
            self.decoder.wait(decoding)  # a decode error is raised by _take, in the training thread
            waited = time.perf_counter() - start
            self.waits += 1
            self.waited_s += waited
            self.longest_s = max(self.longest_s, waited)
            if len(self.wait_at) < 256:
                self.wait_at.append((self.gets, waited))
        return self.recent.add(idx, self._ready(*self._take(idx, decoding)))

    def note(self) -> str | None:
        if not self.waits:
            return None
        return (f"data-bound: {self.waits} of {self.gets} steps waited for their image to be decoded "
                f"({self.waited_s:.1f} s in all, {self.longest_s * 1e3:.0f} ms at most; "
                "data.images_on=host or a smaller data.max_side would avoid it)")

    def close(self) -> None:
        super().close()
        for decoding in self.pending.values():
            decoding.cancel()
        self.pending.clear()
        self.staged.clear()
        self.decoder.close()


def build_image_store(
    views: Sequence[View],
    images_on: str,
    device: torch.device,
    log: Callable[[str], None] = print,
    per_step: int = 1,
    device_free: int | None = None,
    host_available: int | None = None,
    decode_in: str = "processes",
    decode_workers: int = 0,
    fused_remap: bool = True,
) -> ImageStore:
    """The store for data.images_on (auto picks and says so in one line: resolve_images_on).
    per_step: views a step draws (train.batch_size); decode_in: dev.decode_in and decode_workers:
    data.decode_workers (disk only; 0: DISK_WORKERS); fused_remap: dev.fused_remap."""
    where = resolve_images_on(views, images_on, device, log, device_free, host_available)
    if where == "gpu":
        return ResidentStore(views, device, per_step, fused_remap)
    if where == "host":
        return HostStore(views, device, per_step, fused_remap)
    return DiskStore(views, device, per_step, workers=decode_workers or DISK_WORKERS, decode_in=decode_in,
                     fused_remap=fused_remap)


def images_ahead(views: Sequence[View], workers: int = START_WORKERS) -> Iterator[torch.Tensor]:
    """Each view's image ([H, W, 3] uint8, CPU), in order; lazy views are decoded up to `workers`
    views ahead by a thread pool, so a pass that scores streamed views (the step-0 evaluation of a
    data.images_on=disk run) waits on one decode at a time, not on each. Memory: `workers` images."""
    if not any(isinstance(v, LazyView) for v in views):
        yield from (v.image for v in views)
        return
    ahead = max(1, min(workers, len(views)))
    upcoming = iter(views)
    with ThreadPoolExecutor(max_workers=ahead, thread_name_prefix="gstrain-score") as pool:
        pending: deque[Future] = deque(pool.submit(lambda v=v: v.image) for v in itertools.islice(upcoming, ahead))
        while pending:
            image = pending.popleft().result()
            following = next(upcoming, None)
            if following is not None:
                pending.append(pool.submit(lambda v=following: v.image))
            yield image


def decoded(views: list[View], workers: int = START_WORKERS) -> list[View]:
    """The views with every lazy one decoded (in parallel) into a plain View: test views that are
    scored every evaluation, when the store keeps the training images decoded too."""
    if not any(isinstance(v, LazyView) for v in views):
        return views
    images = decode_all(views, workers=workers)
    return [View(v.name, image, v.K, v.viewmat, v.mask) if isinstance(v, LazyView) else v
            for v, image in zip(views, images, strict=True)]


class TrainImages:
    """The store behind the trainer's `train_images[idx]`: indexing fetches (store.get), len()
    counts, `shapes` gives every image's (H, W, 3) without fetching. Iterating is refused: it
    would fetch every image, which is what the store is there to avoid."""

    def __init__(self, store: ImageStore) -> None:
        self.store = store
        self.shapes = [store.shape(i) for i in range(len(store))]

    def __getitem__(self, idx: int) -> torch.Tensor:
        return self.store.get(idx)

    def __len__(self) -> int:
        return len(self.shapes)

    def __iter__(self) -> NoReturn:
        raise TypeError("iterating the training images would fetch them all: use .shapes")

    def prefetch(self, upcoming: Sequence[int]) -> None:
        self.store.prefetch(upcoming)

    @property
    def lookahead(self) -> int:
        return self.store.lookahead


def image_shapes(images: TrainImages | Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    """Each training image's shape: a TrainImages' without fetching, a list of tensors' (resident
    images, e.g. profile_graphs' stand-in trainer) from the tensors."""
    if isinstance(images, TrainImages):
        return list(images.shapes)
    return [tuple(image.shape) for image in images]
