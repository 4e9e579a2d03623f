"""Optimizer state on disk (the NVMe tier): ``DiskState``, the fp32 master weights and AdamW moments of named
parameters kept in one StateFile (``_state_file.py``: a scratch file with asynchronous aligned I/O) and updated
segment by segment through a few staging buffers (read ahead, update, write behind).

File layout of a DiskState: the parameters' values are concatenated in order into one index space of
``total`` values, padded to a multiple of ``SEGMENT_QUANTUM``; the file holds three regions over that space,
master (fp32), exp_avg and exp_avg_sq (the moment dtype), one after another. A segment is a range of that space
(so many small tensors share one large transfer); every segment starts at a multiple of ``SEGMENT_QUANTUM``
values, which puts each region's offset on a 4096-byte boundary, as direct I/O requires.
"""

from __future__ import annotations

import bisect
import errno
import os
import time
from collections.abc import Iterable, Mapping

import torch

from . import _core
from ._args import bump_versions, plain, scalar, seed_number, step_number, thread_count
from ._state_file import _ALIGN, DEFAULT_IO_THREADS, DiskIOError, StateFile, _int, aligned_empty

__all__ = ["DiskIOError", "DiskState", "StateFile", "adamw_step_on_disk", "aligned_empty"]

DEFAULT_SEGMENT_VALUES = 4 << 20
DEFAULT_DEPTH = 3
SEGMENT_QUANTUM = 2048

_FIELDS = ("param", "exp_avg", "exp_avg_sq")
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Staging:
    """One staging buffer set: the master, exp_avg and exp_avg_sq of one segment, each 4096-aligned."""

    def __init__(self, buffer: torch.Tensor, values: int, moment_dtype: torch.dtype):
        mb = torch.empty((), dtype=moment_dtype).element_size()
        raw = buffer.view(-1).view(torch.uint8)
        ends = (values * 4, values * 4 + values * mb, values * (4 + 2 * mb))
        self.whole = raw[:ends[2]]
        self.raw = (raw[:ends[0]], raw[ends[0]:ends[1]], raw[ends[1]:ends[2]])
        self.views = (self.raw[0].view(torch.float32), self.raw[1].view(moment_dtype), self.raw[2].view(moment_dtype))
        self.writes: list[int] = []  # tickets of the last write from this set
        self.stamp = 0  # when it was last written from (sets are reused oldest first)
        self.written: int | None = None  # the segment of ``writes`` while they are pending


def _round_up(value: int, quantum: int) -> int:
    return -(-value // quantum) * quantum


def _check_disjoint(spans: list[tuple[int, int, bool, str]]) -> None:
    """ValueError when two (begin, end, written, label) byte ranges overlap and one of them is written."""
    far_any = far_written = None
    for span in sorted(s for s in spans if s[1] > s[0]):
        hit = far_any if span[2] else far_written
        if hit is not None and span[0] < hit[1]:
            raise ValueError(f"{hit[3]} and {span[3]} share memory; pass distinct buffers")
        if far_any is None or span[1] > far_any[1]:
            far_any = span
        if span[2] and (far_written is None or span[1] > far_written[1]):
            far_written = span


class DiskState:
    """AdamW state (fp32 master weights, exp_avg, exp_avg_sq) of named parameters, kept in one ``StateFile``
    in ``directory`` and updated by ``step`` (or ``adamw_step_on_disk``) with ts_adamw's host kernel,
    bit-for-bit as ``adamw_steps`` over the same tensors in RAM (``keys``: each parameter's
    stochastic-rounding stream, default its position, as ``adamw_steps``).

    ``params``: a mapping (or (name, tensor) pairs) of floating tensors, any shape and device; their values
    become the master weights (as fp32), the moments start at zero (``moment_dtype`` float32 or bfloat16).
    ``segment_values`` (a multiple of ``SEGMENT_QUANTUM``) values are updated per native call; ``depth``
    staging sets of ``DiskState.staging_bytes(segment_values, moment_dtype)`` bytes each are allocated once
    (pageable), or pass ``staging``: that many CPU tensors, 4096-aligned (page-locked ones from ts-pinned's
    arena, say). With 3 or more sets, segment i+1 is read while i updates and i-1 is written; with 2, the
    write of i-1 finishes before the read of i+1 starts; with 1 nothing overlaps. Not thread-safe: one call at
    a time. Everything is released by ``close()`` (or when the object is collected, or the process ends).
    """

    SEGMENT_QUANTUM = SEGMENT_QUANTUM  # segment_values is a multiple of it
    DEFAULT_SEGMENT_VALUES = DEFAULT_SEGMENT_VALUES
    DEFAULT_DEPTH = DEFAULT_DEPTH  # staging sets allocated when neither depth nor staging is given

    def __init__(self, params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                 directory: str | os.PathLike, *, moment_dtype: torch.dtype = torch.float32,
                 segment_values: int = DEFAULT_SEGMENT_VALUES, depth: int | None = None,
                 staging: list[torch.Tensor] | None = None, io_threads: int = DEFAULT_IO_THREADS,
                 direct: bool | None = None, keys: list[int] | None = None):
        items = list(params.items() if isinstance(params, Mapping) else params)
        if not items:
            raise ValueError("DiskState: params is empty; pass at least one named tensor")
        self._names: list[str] = []
        self._shapes: list[torch.Size] = []
        self._starts: list[int] = []
        total = 0
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise ValueError(f"DiskState: params must map names (str) to tensors; got {item!r:.80}")
            name, tensor = item
            tensor = plain(tensor, f"params[{name!r}]")
            if not tensor.is_floating_point():
                raise ValueError(f"DiskState: params[{name!r}] is {tensor.dtype}; pass floating-point tensors")
            if name in self._names:
                raise ValueError(f"DiskState: the name {name!r} appears twice in params")
            self._names.append(name)
            self._shapes.append(tensor.shape)
            self._starts.append(total)
            total += tensor.numel()
        self._index = {name: i for i, name in enumerate(self._names)}
        self.total = total
        if moment_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"DiskState: moment_dtype={moment_dtype} must be torch.float32 or torch.bfloat16")
        self.moment_dtype = moment_dtype
        self._keys = list(range(len(items))) if keys is None else list(keys)
        if len(self._keys) != len(items) or not all(
                isinstance(k, int) and not isinstance(k, bool) and 0 <= k < 2**32 for k in self._keys):
            raise ValueError(f"DiskState: keys must be {len(items)} integers in [0, 2**32), one per parameter")
        _int(segment_values, "segment_values", SEGMENT_QUANTUM)
        if segment_values % SEGMENT_QUANTUM:
            raise ValueError(f"DiskState: segment_values={segment_values} must be a multiple of {SEGMENT_QUANTUM} "
                             "(keeps every transfer 4096-byte aligned)")
        padded = _round_up(max(total, 1), SEGMENT_QUANTUM)
        self.segment_values = min(segment_values, padded)
        mb = torch.empty((), dtype=moment_dtype).element_size()
        self._bases = (0, padded * 4, padded * (4 + mb))  # byte offset of each field's region
        self._elem = (4, mb, mb)
        set_bytes = DiskState.staging_bytes(self.segment_values, moment_dtype)
        if staging is None:
            depth = DEFAULT_DEPTH if depth is None else _int(depth, "depth", 1)
            staging = [aligned_empty(set_bytes) for _ in range(depth)]
        else:
            if isinstance(staging, torch.Tensor) or not isinstance(staging, (list, tuple)) or not staging:
                raise ValueError("DiskState: staging must be a non-empty list of tensors")
            if depth is not None and depth != len(staging):
                raise ValueError(f"DiskState: depth={depth} but {len(staging)} staging buffers were given")
            staging = [self._check_staging(t, i, set_bytes) for i, t in enumerate(staging)]
            _check_disjoint([(t.data_ptr(), t.data_ptr() + set_bytes, True, f"staging[{i}]")
                             for i, t in enumerate(staging)])
        self._sets = [_Staging(t, self.segment_values, moment_dtype) for t in staging]
        self._segments = [(a, min(a + self.segment_values, total)) for a in range(0, total, self.segment_values)]
        self._error: BaseException | None = None
        self._stats: dict[str, float] = {}
        # Read ahead across calls (step's ``prefetch``): segment -> (the staging set it is read into, tickets).
        # At most depth - 2 sets, so a step always has two of its own; dropped before anything else touches
        # the file (read_state, write_state, close).
        self._ready: dict[int, tuple[_Staging, list[int]]] = {}
        self._in_use: list[_Staging] = []  # the running step's sets while it reads ahead
        self._stamp = 0
        self._file = StateFile(directory, padded * (4 + 2 * mb), io_threads=io_threads, direct=direct)
        try:
            self._fill([plain(t, "params") for _, t in items])
        except BaseException:
            self._file.close()
            raise

    @staticmethod
    def staging_bytes(segment_values: int = DEFAULT_SEGMENT_VALUES, moment_dtype: torch.dtype = torch.float32) -> int:
        """Bytes of one staging set: a segment's master weights and both moments."""
        return segment_values * (4 + 2 * torch.empty((), dtype=moment_dtype).element_size())

    def _check_staging(self, t, i: int, set_bytes: int) -> torch.Tensor:
        t = plain(t, f"staging[{i}]")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"DiskState: staging[{i}] must be a contiguous CPU tensor")
        if t.numel() * t.element_size() < set_bytes or t.data_ptr() % _ALIGN:
            raise ValueError(f"DiskState: staging[{i}] has {t.numel() * t.element_size()} bytes at address "
                             f"{t.data_ptr():#x}; each buffer needs {set_bytes} bytes "
                             f"(DiskState.staging_bytes) starting on a 4096-byte boundary")
        return t

    # ---- properties -----------------------------------------------------------------------------------------

    names = property(lambda self: list(self._names), doc="The parameters' names, in file order.")
    depth = property(lambda self: len(self._sets), doc="The staging sets.")
    direct = property(lambda self: self._file.direct, doc="True when the file bypasses the page cache.")
    path = property(lambda self: self._file.path, doc="The scratch file as messages name it.")
    nbytes = property(lambda self: self._file.size, doc="Bytes the file takes on disk.")
    failed = property(lambda self: self._error, doc="The I/O failure that left the state unusable, else None.")
    stats = property(lambda self: dict(self._stats),
                     doc="Seconds of the last step: waiting for reads (the disk behind the kernel), waiting for "
                         "writes (staging sets refilled, the final drain), in the kernel, in all ({} before the "
                         "first step).")
    closed = property(lambda self: self._file.closed, doc="True once close() ran.")

    def _usable(self, what: str) -> None:
        if self._file.closed:
            raise ValueError(f"DiskState.{what}: the state is closed")
        if self._error is not None:
            raise DiskIOError(getattr(self._error, "errno", None) or errno.EIO,
                              f"DiskState.{what}: the state is unusable since a step failed part-way (some "
                              f"segments hold the new step, others the previous one): {self._error}; restore it "
                              "from a checkpoint into a new DiskState")

    # ---- segment I/O ----------------------------------------------------------------------------------------

    def _submit(self, op: str, segment: int, staging: _Staging, fields=(0, 1, 2)) -> list[int]:
        a, b = self._segments[segment]
        io = self._file.read if op == "read" else self._file.write
        return [io(self._bases[f] + a * self._elem[f], staging.raw[f], _round_up((b - a) * self._elem[f], _ALIGN))
                for f in fields]

    def _drain(self, tickets: Iterable[int]) -> BaseException | None:
        """Waits every ticket; returns the first failure (the others are waited too: their buffers are free)."""
        first = None
        for ticket in list(tickets):
            try:
                self._file.wait(ticket)
            except DiskIOError as error:
                first = first or error
        return first

    def _pieces(self, segment: int):
        """(parameter index, first value in the parameter, first value in the segment, count) per parameter
        that the segment covers."""
        a, b = self._segments[segment]
        i = bisect.bisect_right(self._starts, a) - 1
        while i < len(self._names) and self._starts[i] < b:
            start = self._starts[i]
            end = self._starts[i + 1] if i + 1 < len(self._starts) else self.total
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                yield i, lo - start, lo - a, hi - lo
            i += 1

    def _fill(self, params: list[torch.Tensor]) -> None:
        """Writes the master weights (the moments are the file's zeros), segment by segment."""
        outstanding: set[int] = set()
        try:
            for k, (a, b) in enumerate(self._segments):
                staging = self._sets[k % len(self._sets)]
                error = self._drain(staging.writes)
                outstanding.difference_update(staging.writes)
                if error is not None:
                    raise error
                master = staging.views[0]
                for i, local, at, count in self._pieces(k):
                    master[at:at + count].copy_(params[i].reshape(-1)[local:local + count])
                master[b - a:].zero_()  # the padding of the last segment goes to disk too
                staging.writes = self._submit("write", k, staging, fields=(0,))
                outstanding.update(staging.writes)
        finally:
            error = self._drain(outstanding)
            for staging in self._sets:
                staging.writes = []
        if error is not None:
            raise error

    # ---- the step -------------------------------------------------------------------------------------------

    def _selected(self, names) -> list[int]:
        """The indices of the parameters a step updates: all, or ``names`` (each known, each once)."""
        if names is None:
            return list(range(len(self._names)))
        if isinstance(names, str) or not isinstance(names, (list, tuple)) or not names:
            raise ValueError("DiskState.step: names must be None (every parameter) or a non-empty list of names")
        unknown = [n for n in names if n not in self._index]
        if unknown:
            raise ValueError(f"DiskState.step: names has unknown parameters {unknown[:5]}")
        if len(set(names)) != len(names):
            raise ValueError("DiskState.step: names lists a parameter twice")
        return [self._index[n] for n in names]

    def _by_name(self, tensors, what: str, dtypes: tuple, dtype_text: str, selected: list[int]) -> list[torch.Tensor]:
        names = [self._names[i] for i in selected]
        if isinstance(tensors, Mapping):
            missing = [n for n in names if n not in tensors]
            extra = [n for n in tensors if n not in names]
            if missing or extra:
                raise ValueError(f"DiskState.step: {what} must have one tensor per parameter stepped; missing "
                                 f"{missing[:5]}, unknown or not stepped {extra[:5]}")
            tensors = [tensors[n] for n in names]
        elif not isinstance(tensors, (list, tuple)) or len(tensors) != len(names):
            raise ValueError(f"DiskState.step: {what} must be a mapping from name to tensor, or a list of "
                             f"{len(names)} tensors in the order of names (default .names)")
        out = []
        for i, t in zip(selected, tensors):
            name, shape = self._names[i], self._shapes[i]
            t = plain(t, f"{what}[{name!r}]")
            if t.dtype not in dtypes:
                raise ValueError(f"DiskState.step: {what}[{name!r}] is {t.dtype}; use {dtype_text}")
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"DiskState.step: {what}[{name!r}] must be a contiguous CPU tensor")
            if t.numel() != shape.numel():
                raise ValueError(f"DiskState.step: {what}[{name!r}] has {t.numel()} values but the parameter "
                                 f"has {shape.numel()}")
            out.append(t.reshape(-1))
        return out

    def step(self, grads, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
             maximize: bool = False, grad_scale: float = 1.0, params_out=None, seed: int = 0,
             threads: int | None = None, names: list[str] | None = None,
             prefetch: list[str] | None = None, wait_writes: bool = True) -> None:
        """One AdamW step over the state on disk, as ``adamw_steps`` computes it (same arguments; ``grads`` and
        ``params_out`` map each name to a CPU tensor, or are lists in the order of ``.names``).

        ``names``: step only these parameters (``grads`` and ``params_out`` then cover them alone, lists in
        this order); the others' state is left as it is, bit for bit, though a segment they share with a
        stepped parameter is read and written back. A trainer steps each bucket of gradients this way as it
        arrives. ``prefetch``: parameters the next call will step; once this step's own reads are queued, the
        first segments of theirs (as many as leave this step two staging sets, none it writes) start reading,
        so the next step begins with data in hand. A later call that steps other parameters first, or any
        read_state / write_state, simply drops what was read ahead. ``wait_writes`` False: return with the
        last segments' writes still in flight (a trainer's next forward overlaps them); each finishes before
        anything reads its segment again, and at ``flush()``, read_state, write_state and close. A write that
        fails after its step returned leaves the file behind ``params_out``: the state is marked unusable and
        the call that finds it raises.

        What a failure leaves: invalid input raises ``ValueError`` before any I/O. A segment is updated only
        from buffers whose reads completed, so no partially read data reaches the file or ``params_out``. An
        I/O failure (``DiskIOError``) before the first segment's update leaves everything as it was and the
        state usable. A later one (a read of a later segment, or any write) leaves the segments before it with
        this step, on disk and in ``params_out``, and the rest with the previous one: the state is then marked
        unusable (``.failed``), and every later call but ``close()`` raises. Returns once every write is on
        the file.
        """
        self._usable("step")
        selected = self._selected(names)
        grads = self._by_name(grads, "grads", _GRAD_DTYPES, "float32, bfloat16 or float16", selected)
        outs = None if params_out is None else self._by_name(params_out, "params_out", _GRAD_DTYPES,
                                                             "bfloat16, float16 or float32", selected)
        hyper = (scalar(lr, "lr"), scalar(beta1, "beta1"), scalar(beta2, "beta2"), scalar(eps, "eps"),
                 scalar(weight_decay, "weight_decay"), step_number(step), bool(maximize),
                 scalar(grad_scale, "grad_scale"), seed_number(seed), thread_count(threads))
        # The native checks of every scalar, on scratch tensors, before any I/O.
        _core.step_pieces([torch.zeros(1)], [torch.zeros(1)], [torch.zeros(1, dtype=self.moment_dtype)],
                          [torch.zeros(1, dtype=self.moment_dtype)], [], [0], [0], *hyper)
        stepped = [self._names[i] for i in selected]
        spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), False, f"grads[{n!r}]")
                 for n, t in zip(stepped, grads)]
        spans += [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), True, f"params_out[{n!r}]")
                  for n, t in zip(stepped, outs or [])]
        spans += [(s.raw[0].data_ptr(), s.raw[2].data_ptr() + s.raw[2].numel(), True, f"staging[{i}]")
                  for i, s in enumerate(self._sets)]
        _check_disjoint(spans)
        ahead = [] if prefetch is None else self._selected(prefetch)
        self._run(dict(zip(selected, grads)), None if outs is None else dict(zip(selected, outs)), hyper, ahead,
                  bool(wait_writes))
        if outs is not None:
            bump_versions(outs)

    def _update(self, segment: int, staging: _Staging, grads, outs, hyper) -> None:
        ps, gs, ms, vs, os_, slots, offsets = [], [], [], [], [], [], []
        for i, local, at, count in self._pieces(segment):
            if i not in grads:  # not stepped: its values go back to the file as they were read
                continue
            ps.append(staging.views[0][at:at + count])
            ms.append(staging.views[1][at:at + count])
            vs.append(staging.views[2][at:at + count])
            gs.append(grads[i][local:local + count])
            if outs is not None:
                os_.append(outs[i][local:local + count])
            slots.append(self._keys[i])
            offsets.append(local)
        _core.step_pieces(ps, gs, ms, vs, os_, slots, offsets, *hyper)

    def _segments_of(self, selected) -> list[int]:
        """The segments that hold any value of the selected parameters, in file order."""
        out: list[int] = []
        for i in sorted(selected):
            start = self._starts[i]
            end = self._starts[i + 1] if i + 1 < len(self._starts) else self.total
            for k in range(start // self.segment_values, -(-end // self.segment_values)):
                if end > start and (not out or out[-1] < k):
                    out.append(k)
        return out

    def _free_set(self, busy: list[_Staging]) -> _Staging:
        """A staging set for the next read: not holding a segment read ahead nor one of ``busy``; the one
        written longest ago. Its writes are drained by the caller."""
        held = {id(st) for st, _ in self._ready.values()} | {id(st) for st in busy}
        return min((st for st in self._sets if id(st) not in held), key=lambda st: st.stamp)

    def _read_into(self, segment: int, busy: list[_Staging], stats: dict) -> tuple[_Staging, list[int]]:
        """Queues the read of ``segment``: taken from what was read ahead, or into a free set once that
        set's last writes are on the file."""
        if segment in self._ready:
            return self._ready.pop(segment)
        staging = self._free_set(busy)
        t = time.perf_counter()
        self._settle(segment)  # a write of this segment still in flight lands first
        self._drain_writes(staging)  # the set's last write is on disk before it is refilled
        stats["write_wait_s"] += time.perf_counter() - t
        return staging, self._submit("read", segment, staging)

    def _drain_writes(self, staging: _Staging) -> None:
        """Waits for the set's pending writes. A failed one means the file lacks what a step computed (and
        returned in ``params_out``): the state is marked unusable."""
        writes, staging.writes, staging.written = staging.writes, [], None
        error = self._drain(writes)
        if error is not None:
            self._error = error
            raise error

    def _settle(self, segment: int | None = None) -> None:
        """Waits for the pending writes of ``segment`` (None: of every segment)."""
        for staging in self._sets:
            if staging.writes and (segment is None or staging.written == segment):
                self._drain_writes(staging)

    def flush(self) -> None:
        """Waits for every write still in flight (``step(wait_writes=False)``); DiskIOError when one failed."""
        self._usable("flush")
        self._settle()

    def _read_ahead(self, ahead: list[int], own: list[int]) -> None:
        """Starts reading the first segments of the parameters ``ahead``, in that order (not ``own``, which
        this step writes), keeping two sets for the running step; a set still writing an older segment is
        waited for first (its write was queued before this step's)."""
        wanted = [k for i in ahead for k in self._segments_of([i])]  # in the order the next step will want them
        wanted = [k for k in dict.fromkeys(wanted) if k not in own and k not in self._ready]
        for segment in wanted[:max(0, len(self._sets) - 2 - len(self._ready))]:
            held = {id(st) for st, _ in self._ready.values()} | {id(st) for st in self._in_use}
            free = [st for st in self._sets if id(st) not in held]
            if not free:
                return
            staging = min(free, key=lambda st: (bool(st.writes), st.stamp))
            self._settle(segment)
            self._drain_writes(staging)
            self._ready[segment] = (staging, self._submit("read", segment, staging))

    def _drop_ready(self) -> None:
        """Forgets every segment read ahead (their reads finish first: the buffers are reused)."""
        ready, self._ready = self._ready, {}
        self._drain([t for _, tickets in ready.values() for t in tickets])

    def _run(self, grads: dict, outs: dict | None, hyper, ahead: list[int], wait_writes: bool) -> None:
        """Steps the segments of the parameters in ``grads`` (index -> flat gradient): read ahead, update,
        write behind, through the staging sets; then reads ahead the first segments of ``ahead``."""
        order = self._segments_of(grads)
        for segment in [k for k in self._ready if k not in order]:
            # read ahead for another call: still valid (nothing wrote it since), but its set is needed
            self._drain(self._ready.pop(segment)[1])
        depth, count = len(self._sets), len(order)
        lead = 0 if depth == 1 else max(1, depth - 2)  # segments read ahead; one set is left to write behind
        reads: dict[int, tuple[_Staging, list[int]]] = {}
        issued = 0
        changed = False  # a segment's update began: params_out or the file may differ from before
        clock = time.perf_counter
        stats = self._stats = {"read_wait_s": 0.0, "write_wait_s": 0.0, "update_s": 0.0, "step_s": 0.0}
        started = clock()
        try:
            for j in range(count):
                while issued < min(j + 1 + lead, count):
                    reads[issued] = self._read_into(order[issued], [st for st, _ in reads.values()], stats)
                    issued += 1
                    if issued == count and ahead:
                        self._in_use = [st for st, _ in reads.values()]
                        self._read_ahead(ahead, order)
                staging, tickets = reads.pop(j)
                t = clock()
                error = self._drain(tickets)
                stats["read_wait_s"] += clock() - t
                if error is not None:
                    raise error
                changed = True
                t = clock()
                self._update(order[j], staging, grads, outs, hyper)
                stats["update_s"] += clock() - t
                staging.writes, staging.written = self._submit("write", order[j], staging), order[j]
                self._stamp += 1
                staging.stamp = self._stamp
            t = clock()
            if wait_writes:
                self._settle()
            stats["write_wait_s"] += clock() - t
            stats["step_s"] = clock() - started
        except BaseException as error:
            pending = [t for _, tickets in reads.values() for t in tickets]
            for staging in self._sets:
                pending += staging.writes
                staging.writes, staging.written = [], None
            self._drain(pending)  # no transfer may outlive the step: the buffers are reused
            if changed:
                self._error = error
                self._drop_ready()
            raise
        finally:
            self._in_use = []

    # ---- state in and out -----------------------------------------------------------------------------------

    def _range(self, name: str, field: int, out: torch.Tensor | None, src: torch.Tensor | None) -> None:
        """Copies one field of one parameter from the file into ``out``, or from ``src`` into the file
        (read-modify-write of the edge blocks), in pieces through staging set 0."""
        i = self._index[name]
        elem, start = self._elem[field], self._starts[i]
        first, last = self._bases[field] + start * elem, self._bases[field] + (start + self._shapes[i].numel()) * elem
        bounce = self._sets[0].whole
        window = bounce.numel() // _ALIGN * _ALIGN
        flat = (out if out is not None else src).view(-1).view(torch.uint8)
        lo = first // _ALIGN * _ALIGN
        while lo < last:
            hi = min(_round_up(last, _ALIGN), lo + window)
            self._file.wait(self._file.read(lo, bounce, hi - lo))
            a, b = max(lo, first), min(hi, last)
            if out is not None:
                flat[a - first:b - first].copy_(bounce[a - lo:b - lo])
            else:
                bounce[a - lo:b - lo].copy_(flat[a - first:b - first])
                self._file.wait(self._file.write(lo, bounce, hi - lo))
            lo = hi

    def read_state(self, name: str) -> dict[str, torch.Tensor]:
        """The parameter's ``{"param": fp32 master, "exp_avg", "exp_avg_sq"}`` as new CPU tensors of its shape
        (for a state_dict)."""
        self._usable("read_state")
        self._drop_ready()  # its bounce buffer may hold a segment read ahead
        self._settle()  # and every write lands first
        if name not in self._index:
            raise KeyError(f"DiskState.read_state: no parameter named {name!r}")
        shape = self._shapes[self._index[name]]
        out = {}
        for field, key in enumerate(_FIELDS):
            out[key] = torch.empty(shape, dtype=torch.float32 if field == 0 else self.moment_dtype)
            self._range(name, field, out[key], None)
        return out

    def write_state(self, name: str, param: torch.Tensor | None = None, exp_avg: torch.Tensor | None = None,
                    exp_avg_sq: torch.Tensor | None = None) -> None:
        """Replaces the given parts of one parameter's state (from a state_dict): tensors of its value count,
        converted to fp32 / the moment dtype. Validated before anything is written."""
        self._usable("write_state")
        self._drop_ready()  # what was read ahead may be what this writes
        self._settle()
        if name not in self._index:
            raise KeyError(f"DiskState.write_state: no parameter named {name!r}")
        numel = self._shapes[self._index[name]].numel()
        sources = []
        for field, (key, t) in enumerate(zip(_FIELDS, (param, exp_avg, exp_avg_sq))):
            if t is None:
                continue
            t = plain(t, key)
            if not t.is_floating_point() or t.numel() != numel:
                raise ValueError(f"DiskState.write_state: {key} must be a floating tensor of {numel} values; got "
                                 f"{t.dtype} with {t.numel()}")
            dtype = torch.float32 if field == 0 else self.moment_dtype
            sources.append((field, t.detach().to("cpu", dtype).contiguous()))
        try:
            for field, t in sources:
                self._range(name, field, None, t)
        except DiskIOError as error:
            self._error = error  # some blocks may hold the new values, others the old
            raise

    def close(self) -> None:
        """Waits for any transfer, closes and frees the file, drops the staging buffers this object
        allocated. Safe to call twice."""
        if not self._file.closed:
            self._drop_ready()
        self._file.close()
        self._sets = []

    def __enter__(self) -> DiskState:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def adamw_step_on_disk(state: DiskState, grads, *, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, step: int, maximize: bool = False, grad_scale: float = 1.0,
                       params_out=None, seed: int = 0, threads: int | None = None) -> None:
    """``state.step(grads, ...)``: one AdamW step over the ``DiskState``'s state on disk (see ``DiskState.step``)."""
    state.step(grads, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
               maximize=maximize, grad_scale=grad_scale, params_out=params_out, seed=seed, threads=threads)
