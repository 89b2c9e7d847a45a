"""How staged KV bytes move (pd_mooncake.staging): registered memory, the
indexed copy between the KV caches and the staging buffer, and its ordering
against vLLM's forward pass.

The copy. A send's descriptors are upstream's block runs, one per region
and run (hundreds to thousands on fragmented block lists). Per pair of
tensors (a KV region's cache and the staging buffer) they become one
indexed copy: both tensors viewed as rows of the largest size that divides
every offset and length of the pair (a page or a block), and one
``index_select`` (gather into a contiguous record) or ``index_copy_``
(scatter from one) over the rows' indexes, instead of a copy per run.

The ordering. vLLM 0.32 runs the forward pass on a stream of its own
(vllm.utils.torch_utils.current_stream: a per-process stream set as the
worker's main thread's current stream, not the default stream), and zeroes
newly allocated KV blocks on it before the step's forward (the model runner's
_update_states, _zero_block_ids). The copies run from the connector's sender
and receiver threads. Rather than a device-wide ``torch.cuda.synchronize``
(which waits for the forward step in flight: on decode that made every
staged pull's step synchronous), they run on a stream of the worker's own
that first waits on an event the main thread recorded on the forward stream
at ``bind_connector_metadata`` (``Ordering.mark_kv_ready``), before the
step's forward is enqueued:

- prefill: a request's send becomes ready (upstream's record_send_reqs) only
  from ``start_load_kv`` of a step after the one whose forward computed its
  last KV, so the latest mark covers that forward: the gather reads complete
  KV and waits for no step launched later;
- decode: the pull starts from that step's ``start_load_kv``, after the
  zeroing of its blocks was enqueued, so the scatter lands after the zeroing.

The host then waits for the staging stream's own work only (an event):
prefill's Mooncake write reads the buffer outside any stream, decode's
checksum and the next forward read the blocks.

Without CUDA (the CPU twin, the unit tests) the same code runs with no-op
stand-ins for streams and events (``HostStreams``).
"""

from __future__ import annotations

import bisect
import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch


def staging_home(protocol: str, kv_device: torch.device) -> torch.device:
    """Where the staging buffer lives. KV on a GPU: over TCP, pinned host
    memory (Mooncake's TCP transport copies device memory to the host before
    the socket; a host buffer is that copy, done by the gather); over RDMA,
    the KV's device (GPUDirect: the NIC reads and writes GPU memory, and a
    host buffer would add a crossing of PCIe). KV in host memory: there."""
    import torch

    if kv_device.type == "cuda" and protocol == "tcp":
        return torch.device("cpu")
    return kv_device


class Memory:
    """Registered memory (the KV caches, or the staging buffer): which tensor
    holds an address."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        import numpy as np
        import torch

        storages: dict[int, torch.Tensor] = {}
        for t in tensors:
            s = t.untyped_storage()
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(s)
            storages[s.data_ptr()] = flat
        self._starts = sorted(storages)
        self._tensors = [storages[a] for a in self._starts]
        # The same, as arrays: ``move`` locates a send's ranges all at once.
        self._start_array = np.array(self._starts, dtype=np.int64)
        self._size_array = np.array([t.numel() for t in self._tensors], dtype=np.int64)
        # The devices other than the CPU this memory lies on (none: host memory).
        self.devices = {t.device for t in self._tensors if t.device.type != "cpu"}

    def locate(self, addr: int, nbytes: int) -> tuple[int, int] | None:
        """(which tensor, offset in it) of ``nbytes`` at ``addr``, or None."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or nbytes < 0:
            return None
        offset = addr - self._starts[i]
        return (i, offset) if offset + nbytes <= self._tensors[i].numel() else None

    def locate_all(
        self, addrs: np.ndarray, nbytes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``locate`` of each range (int64 arrays): which tensor, the offset
        in it, and whether the range lies inside it."""
        import numpy as np

        if not len(self._starts):
            zeros = np.zeros(len(addrs), dtype=np.int64)
            return zeros, zeros, np.zeros(len(addrs), dtype=bool)
        i = np.searchsorted(self._start_array, addrs, side="right") - 1
        index = np.maximum(i, 0)
        offset = addrs - self._start_array[index]
        inside = (i >= 0) & (nbytes >= 0) & (offset + nbytes <= self._size_array[index])
        return index, offset, inside

    def contains(self, addr: int, nbytes: int) -> bool:
        return self.locate(addr, nbytes) is not None

    def flat(self, index: int) -> torch.Tensor:
        """The whole storage of tensor ``index`` as bytes."""
        return self._tensors[index]

    def view(self, addr: int, nbytes: int) -> torch.Tensor:
        found = self.locate(addr, nbytes)
        if found is None:
            raise ValueError(f"{nbytes} bytes at {addr:#x} are not registered memory")
        i, offset = found
        return self._tensors[i][offset : offset + nbytes]

    def read_words(self, addr: int, count: int) -> np.ndarray:
        import numpy as np

        return self.view(addr, count * 8).cpu().numpy().view(np.uint64)

    def write_words(self, addr: int, words: np.ndarray) -> None:
        import numpy as np
        import torch

        data = torch.from_numpy(words.view(np.uint8).copy())
        self.view(addr, words.nbytes).copy_(data)


# -- streams and events: CUDA's, or no-op stand-ins -------------------------------
class HostEvent:
    def __init__(self, log: list[str] | None = None, name: str = "event") -> None:
        self._log, self.name = log, name

    def record(self, stream: Any = None) -> None:
        self._note(f"record {self.name} on {getattr(stream, 'name', stream)}")

    def synchronize(self) -> None:
        self._note(f"host waits for {self.name}")

    def query(self) -> bool:
        return True

    def _note(self, what: str) -> None:
        if self._log is not None:
            self._log.append(what)


class HostStream:
    def __init__(self, log: list[str] | None = None, name: str = "stream") -> None:
        self._log, self.name = log, name

    def wait_event(self, event: HostEvent) -> None:
        if self._log is not None:
            self._log.append(f"{self.name} waits for {event.name}")

    def synchronize(self) -> None:
        # A stream-wide wait: what the ordering must never do to the forward
        # stream (the recorder makes it visible).
        if self._log is not None:
            self._log.append(f"host waits for all of {self.name}")


@dataclass
class HostStreams:
    """Stand-ins for ``torch.cuda``'s streams where there is no GPU: the same
    calls, nothing to wait for. With ``log``, every call is written down in
    order (the tests' recorder)."""

    log: list[str] | None = None
    forward: HostStream = field(init=False)
    _events: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.forward = HostStream(self.log, "forward")

    def current_stream(self, device: Any) -> HostStream:
        return self.forward

    def new_stream(self, device: Any) -> HostStream:
        return HostStream(self.log, "staging")

    def new_event(self, name: str) -> HostEvent:
        self._events += 1
        return HostEvent(self.log, f"{name}#{self._events}")

    def use(self, stream: HostStream) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


class CudaStreams:
    """``torch.cuda``'s streams and events on one device."""

    def current_stream(self, device: Any) -> Any:
        import torch

        return torch.cuda.current_stream(device)

    def new_stream(self, device: Any) -> Any:
        import torch

        return torch.cuda.Stream(device)

    def new_event(self, name: str) -> Any:
        import torch

        return torch.cuda.Event()

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        import torch

        # Also makes the stream's device current in this thread: the sender
        # threads' current device is 0 whatever the rank's.
        return torch.cuda.stream(stream)


class Ordering:
    """The staging stream, and the forward stream's latest KV-ready mark."""

    def __init__(self, device: Any, streams: Any = None) -> None:
        self.device = device
        if streams is None:
            cuda = getattr(device, "type", "cpu") == "cuda"
            streams = CudaStreams() if cuda else HostStreams()
        self.streams = streams
        self.stream = streams.new_stream(device)
        # Written by the main thread, read by the sender/receiver threads
        # (one reference, replaced whole).
        self._kv_ready: Any = None

    def mark_kv_ready(self) -> None:
        """On the worker's main thread, where its current stream is the
        forward's, before a step's forward is enqueued (bind_connector_metadata):
        every KV write enqueued so far (earlier steps, this step's zeroing)
        precedes this mark."""
        event = self.streams.new_event("kv-ready")
        event.record(self.streams.current_stream(self.device))
        self._kv_ready = event

    @contextlib.contextmanager
    def staged(self) -> Iterator[None]:
        """Copies inside run on the staging stream after the latest mark; on
        leaving, the host waits for them, and only them."""
        kv_ready = self._kv_ready
        with self.streams.use(self.stream):
            if kv_ready is not None:
                self.stream.wait_event(kv_ready)
            yield
            done = self.streams.new_event("staged")
            done.record(self.stream)
        done.synchronize()


# -- the indexed copy -------------------------------------------------------------
def _rows(offsets: np.ndarray, lengths: np.ndarray, row: int) -> np.ndarray:
    """The row indexes (rows of ``row`` bytes) covering each range in order."""
    import numpy as np

    counts = lengths // row
    total = int(counts.sum())
    before = np.concatenate(([0], np.cumsum(counts)[:-1]))
    return np.repeat(offsets // row - before, counts) + np.arange(total)


def _as_rows(flat: torch.Tensor, row: int, width: int) -> torch.Tensor:
    import torch

    dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]
    usable = flat.numel() - flat.numel() % row
    return flat[:usable].view(dtype).view(-1, row // width)


def _span(rows: np.ndarray) -> slice | None:
    """The rows as a slice if they are consecutive and ascending."""
    import numpy as np

    if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and np.all(np.diff(rows) == 1):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return None


def _move_rows(
    dst: torch.Tensor, dst_rows: np.ndarray, src: torch.Tensor, src_rows: np.ndarray
) -> None:
    """``dst[dst_rows] = src[src_rows]``: one gather where the destination
    rows are consecutive, one scatter where the source's are, else both."""
    import torch

    d_span, s_span = _span(dst_rows), _span(src_rows)
    same = dst.device == src.device
    if d_span is not None and s_span is not None:
        dst[d_span].copy_(src[s_span], non_blocking=True)
        return
    if s_span is not None:
        rows = src[s_span]
    else:
        index = torch.from_numpy(src_rows).to(src.device, non_blocking=True)
        if d_span is not None and same:
            torch.index_select(src, 0, index, out=dst[d_span])
            return
        rows = src.index_select(0, index)
    if not same and dst.device.type == "cpu":
        # Device to pinned host (prefill's gather): the copy into the buffer
        # is the transfer, a stream operation the host waits for (staged()).
        # Never ``.to("cpu", non_blocking=True)`` then a host copy: the host
        # copy would read the rows before the transfer landed.
        if d_span is not None:
            dst[d_span].copy_(rows, non_blocking=True)
            return
        rows = rows.to("cpu")
    elif not same:
        # Pinned host to device (decode's scatter): ordered on this stream
        # before the index_copy_ that reads it.
        rows = rows.to(dst.device, non_blocking=True)
    if d_span is not None:
        dst[d_span].copy_(rows, non_blocking=True)
    else:
        index = torch.from_numpy(dst_rows).to(dst.device, non_blocking=True)
        dst.index_copy_(0, index, rows)


def move(
    to: Memory,
    dsts: Sequence[int],
    source: Memory,
    srcs: Sequence[int],
    lengths: Sequence[int],
) -> int:
    """Each ``lengths[i]`` bytes from ``srcs[i]`` in ``source`` to ``dsts[i]``
    in ``to``, on the current stream (``Ordering.staged``); every range is
    checked before the first copy (decode reads the destinations from the
    network). Returns the number of indexed copies (one per pair of tensors)."""
    import numpy as np

    d, s, n = (np.array(x, dtype=np.int64) for x in (dsts, srcs, lengths))
    if not len(d) == len(s) == len(n):
        raise ValueError("move: destinations, sources and lengths differ in count")
    # All ranges at once: a fragmented send has thousands, and a locate each
    # cost the sender (or receiver) thread milliseconds. The first bad range
    # is reported, before any copy.
    d_at, d_offset, d_in = to.locate_all(d, n)
    s_at, s_offset, s_in = source.locate_all(s, n)
    if (bad := ~(d_in & s_in)).any():
        k = int(np.argmax(bad))
        addr = int(d[k] if not d_in[k] else s[k])
        raise ValueError(f"{int(n[k])} bytes at {addr:#x} are not registered memory")
    keep = n != 0
    placed: dict[tuple[int, int], np.ndarray] = {}
    pairs = zip(d_at[keep].tolist(), s_at[keep].tolist(), strict=True)
    for pair in dict.fromkeys(pairs):
        chosen = keep & (d_at == pair[0]) & (s_at == pair[1])
        placed[pair] = np.stack([d_offset[chosen], s_offset[chosen], n[chosen]], 1)
    for (d_index, s_index), table in placed.items():
        d_flat, s_flat = to.flat(d_index), source.flat(s_index)
        # Rows as large as every offset and length allows (a page, a block),
        # read as the widest words both tensors' alignment allows.
        row = int(np.gcd.reduce(table.ravel()))
        width = math.gcd(row, 8, d_flat.data_ptr(), s_flat.data_ptr())
        _move_rows(
            _as_rows(d_flat, row, width),
            _rows(table[:, 0], table[:, 2], row),
            _as_rows(s_flat, row, width),
            _rows(table[:, 1], table[:, 2], row),
        )
    return len(placed)


_DEFAULT: dict[Any, Ordering] = {}


def copy(
    to: Memory,
    dsts: Sequence[int],
    source: Memory,
    srcs: Sequence[int],
    lengths: Sequence[int],
    ordering: Ordering | None = None,
) -> None:
    """``move`` on the staging stream of ``ordering`` (by default one per
    device, with no KV-ready mark), returning once the bytes are in place."""
    if ordering is None:
        devices = sorted(to.devices | source.devices, key=str)
        device = devices[0] if devices else None
        ordering = _DEFAULT.setdefault(device, Ordering(device))
    with ordering.staged():
        move(to, dsts, source, srcs, lengths)
