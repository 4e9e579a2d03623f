"""The measuring side of activation_offload='auto' / recompute='auto' (rules in ``tuner.py``).

Phases: ``probe`` (the first forward with gradients: one block is measured, the others are decided
before they run), ``trial`` (one step per candidate setting, timed with the device synchronized
at step(); each step's peak corrects the VRAM estimate; when every paging trial lost to paging
nothing, one more pages half as many blocks as the fewest tried; a trial step in which torch.compile
compiled runs again, up to twice), ``settled`` (the fastest trial's
setting, no more synchronizing). The owner, ``ActivationPolicy``, applies each setting between
steps; this class only measures and decides.

The watchdog (settled): a batch with more tokens than the measured ones saves proportionally more,
and so does the rest of the step (the output layer, the loss; not what was allocated before the
forward: weights, optimizer state); before such a forward runs, the setting is re-chosen for the
scaled sizes, keeping fewer blocks in VRAM (it never keeps more again: a shorter batch later fits in
what a longer one did). When even recomputing every block leaves no room, the forward is refused
(``BatchRefused``, before any block runs) instead of running out of VRAM partway.
"""

from __future__ import annotations

import sys
import time

import torch

from .. import _topology
from .._units import fmt_bytes, fmt_seconds
from ..memory.sizing import PlanRefused, vram_budget
from .tuner import Choice, Measured, choose, trial_candidates

__all__ = ["ActivationTuner", "BatchRefused", "CudaMeter", "Meter"]

MAX_RETIMED = 2  # a trial that compiles again and again (recompiles every step) is timed as it is


class BatchRefused(PlanRefused):
    """A forward longer than the measured ones cannot fit whatever the activation policy does; raised
    before its first block runs (a PlanRefused: a MemoryError and a ValueError)."""

# Each measured peak is trusted to this share of the budget.
PEAK_MARGIN = 0.03


class Meter:
    """Memory and time as the tuner sees them; the CPU default has no VRAM limit (everything stays).
    Tests pass their own (a budget, a clock) to drive the same decisions without a GPU."""

    def __init__(self, budget: int | None = None, link_bytes_per_s: float = 50e9, host_bytes: int | None = None):
        self._budget = budget
        self._link = link_bytes_per_s
        self._host = host_bytes
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self.retries = 0

    def budget(self) -> int | None:
        return self._budget

    def alloc_retries(self) -> int:
        """Times so far the allocator found no cached block, freed its cache and retried (each one
        synchronizes the GPU): a step that adds some ran at the cap."""
        return self.retries

    def allocated(self) -> int:
        return self.allocated_bytes

    def peak(self) -> int:
        return self.peak_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.allocated_bytes

    def synchronize(self) -> None:
        return None

    def now(self) -> float:
        return time.perf_counter()

    def mark(self):
        return self.now()

    def elapsed(self, start, end) -> float:
        return end - start

    def link_bytes_per_s(self) -> float:
        return self._link

    def compilations(self) -> int:
        """torch.compile's work so far in this process (dynamo and inductor phases run, backward graphs
        compiled at their first backward included): a trial step that adds some timed the compiler."""
        utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing compiled (importing it costs a second)
        metrics = getattr(utils, "compilation_time_metrics", None) or {}
        return sum(len(times) for times in metrics.values())

    def host_bytes(self) -> int:
        if self._host is not None:
            return self._host
        import ts_pinned
        return ts_pinned.page_lock_budget(processes=_topology.local_process_count()).budget


class CudaMeter(Meter):
    def __init__(self, device: torch.device, headroom: float):
        super().__init__()
        self.device = device
        self.headroom = headroom
        self._link_cached = None

    def budget(self) -> int:
        return vram_budget(self.device, self.headroom)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def alloc_retries(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3

    def link_bytes_per_s(self) -> float:
        if self._link_cached is None:
            import ts_planner
            rates = ts_planner.measure_link(self.device, 64 << 20, 3)
            self._link_cached = 1e9 * min(rates["h2d_gbps"], rates["d2h_gbps"])
        return self._link_cached

    def host_bytes(self) -> int:
        import ts_pinned
        budget = ts_pinned.page_lock_budget(processes=_topology.local_process_count()).budget
        stats = ts_pinned.default_arena().stats()
        return max(0, budget - stats["arena_bytes"] + (stats["arena_bytes"] - stats["arena_used"]))


class ActivationTuner:
    """Decides the policy for ``blocks`` blocks. ``page`` / ``recompute``: which paths it may use.
    ``reserved_link_bytes``: a callable giving the H2D bytes backward already moves besides the
    pages (the optimizer's uploads, the streamed weights). ``reserved_vram_bytes``: a callable giving the VRAM the
    optimizer state will move into once the policy settles (offload='auto'); kept activations leave
    it free when the state fits at all, since a state in VRAM removed more time than kept
    activations saved (a 14B LoRA step with a streamed bf16 base was faster with every block
    recomputed and the state in VRAM than keeping some blocks' activations with the state left on the
    host; measured: docs/benchmarks.md)."""

    def __init__(self, blocks: int, meter: Meter, events, *, page: bool, recompute: bool,
                 reserved_link_bytes=lambda: 0, reserved_vram_bytes=lambda: 0):
        self.blocks = blocks
        self.meter = meter
        self.events = events
        self.page, self.recompute = page, recompute
        self.reserved_link_bytes = reserved_link_bytes
        self.reserved_vram_bytes = reserved_vram_bytes
        self.vram_left_for_state = 0  # of the room, what the last correction left for the optimizer state
        self.phase = "probe"
        self.measured: Measured | None = None
        self.candidates: list[Choice] = []
        self.trials: list[tuple[Choice, float, int]] = []  # (choice, seconds, peak bytes)
        self.current: Choice | None = None
        self.history: list[str] = []
        self._forward_start = None
        self._probe_start = None
        self._trial = 0
        self._refined = False  # the one trial between paging nothing and the fewest pages tried
        self._marks: dict[int, list] = {}  # block -> [start, end] marks of the current step
        self.tokens: int | None = None  # tokens per forward the sizes in `measured` were taken at
        self.base_bytes = 0  # the last measured peak less the kept blocks' activations
        self.static_bytes = 0  # of base_bytes, what was allocated before the forward (does not scale)
        self._static_now = 0
        self._retries_seen = 0  # the allocator's retry count at the last step's end
        self._compilations_at_start = 0  # Meter.compilations() when the step's first forward started
        self._retimed = 0  # times the current trial ran again because torch.compile worked during it
        self.cap_backoffs = 0  # settled steps that ran at the cap and kept fewer blocks after

    @property
    def settled(self) -> bool:
        return self.phase == "settled"

    def _event(self, text: str) -> None:
        self.history.append(text)
        self.events.add("activations", text)

    # ---- probe -----------------------------------------------------------------------

    def forward_started(self) -> None:
        """The first forward (with gradients) since the last step."""
        if self._forward_start is None:
            self._forward_start = self.meter.now()
            self._static_now = self.meter.allocated()
            self._compilations_at_start = self.meter.compilations()

    def probe_begin(self) -> None:
        """The probed block's forward starts."""
        self.meter.reset_peak()
        self.meter.synchronize()
        self._probe_start = self.meter.now()

    def probe_end(self, probe_bytes: int) -> Choice:
        """The probed block's forward ended: measures and decides the other blocks for this step."""
        self.meter.synchronize()
        forward_s = max(self.meter.now() - self._probe_start, 1e-6)
        budget = self.meter.budget()
        # The probe keeps nothing more: the output layer, the loss and backward's working memory are
        # only known from its peak (at 4 x 2048 with a 152k vocabulary the loss alone took 12 GB).
        room = 1 << 62 if budget is None else 0
        self.measured = Measured(blocks=self.blocks, block_bytes=int(probe_bytes), forward_s=forward_s,
                                 link_bytes_per_s=self.meter.link_bytes_per_s(), room_bytes=room,
                                 host_bytes=self.meter.host_bytes(), reserved_link_bytes=self.reserved_link_bytes())
        # With recompute allowed, the probe recomputes the other blocks: no page pool is page-locked
        # for a setting the trials may reject.
        self.current = choose(self.measured, page=self.page, recompute=self.recompute,
                              paged=0 if self.recompute else None)
        where = ("no VRAM limit (CPU)" if budget is None else
                 "none kept in VRAM until this step's peak shows what the rest of the step needs")
        self._event(f"probe: one block saves {fmt_bytes(probe_bytes)} for backward and runs forward in "
                    f"{fmt_seconds(forward_s)} (first call: re-timed in the next steps); {where}; this step: "
                    f"{self.describe(self.current)}")
        self.phase = "measuring"
        return self.current

    def block_started(self, index: int) -> None:
        if self.phase in ("measuring", "trial"):
            self._marks[index] = [self.meter.mark(), None]

    def block_finished(self, index: int) -> None:
        mark = self._marks.get(index)
        if mark is not None and mark[1] is None:
            mark[1] = self.meter.mark()

    def _timed_forward(self) -> float | None:
        """The median block forward of the step just synchronized (None when none was timed)."""
        times = sorted(max(self.meter.elapsed(a, b), 1e-6) for a, b in self._marks.values() if b is not None)
        self._marks = {}
        return times[len(times) // 2] if times else None

    # ---- between steps ------------------------------------------------------------------

    def step_finished(self) -> Choice | None:
        """At step(): times the step, corrects the room from its peak and returns the setting for the
        next step (None: unchanged)."""
        retries = self.meter.alloc_retries()
        at_cap, self._retries_seen = retries - self._retries_seen, retries
        if self.phase == "settled" and at_cap > 0 and self.measured is not None:
            self._forward_start = None
            return self._back_off(at_cap)
        if self.phase in ("probe", "settled") or self.measured is None:
            self._forward_start = None
            return None
        self.meter.synchronize()
        seconds = self.meter.now() - (self._forward_start or self.meter.now())
        measured_peak = peak = self.meter.peak()
        self._forward_start = None
        budget = self.meter.budget()
        if at_cap > 0 and budget is not None:
            peak = max(peak, budget + 1)  # a trial that ran at the cap does not fit
        m = self.measured
        timed = self._timed_forward()
        if timed is not None:
            m = self.measured = Measured(**{**m.__dict__, "forward_s": timed})
        if budget is not None and m.block_bytes > 0:
            kept = len(self.current.kept)
            self.base_bytes = max(0, peak - kept * m.block_bytes)
            self.static_bytes = min(self._static_now, self.base_bytes)
            limit = int(budget * (1 - PEAK_MARGIN))
            state = max(0, int(self.reserved_vram_bytes()))
            self.vram_left_for_state = state if self.base_bytes + state <= limit else 0
            room = limit - self.base_bytes - self.vram_left_for_state
            m = self.measured = Measured(**{**m.__dict__, "room_bytes": max(0, room),
                                            "reserved_link_bytes": self.reserved_link_bytes()})
        if self.phase == "measuring":
            # The probe step is not timed (it synchronized at the probed block and grew the page pool).
            # Fewest pages first: a paging trial whose copies alone would take longer than the best
            # step measured so far is not run (nor its pool page-locked).
            self.candidates = sorted(trial_candidates(m, page=self.page, recompute=self.recompute),
                                     key=lambda c: len(c.paged))
            self._trial = 0
            self.phase = "trial"
        elif self.meter.compilations() != self._compilations_at_start and self._retimed < MAX_RETIMED:
            # Compiled blocks compile at their first call (and the paths a new setting takes, at theirs):
            # a trial timed with its compiles can take tens of times its real step (docs/benchmarks.md).
            self._retimed += 1
            self._event(f"trial: {self.describe(self.current)}: torch.compile compiled during the step "
                        f"({fmt_seconds(seconds)}): timed again in the next step")
            self.meter.reset_peak()
            return None
        else:
            self._retimed = 0
            self.trials.append((self.current, seconds, peak))
            cap = (f" (the allocator ran out of cached VRAM {at_cap} times and synchronized the GPU: "
                   f"counted as not fitting)" if at_cap > 0 else "")
            self._event(f"trial: {self.describe(self.current)}: {fmt_seconds(seconds)}, peak "
                        f"{fmt_bytes(measured_peak)}" + cap)
            self._trial += 1
            self._prune(m)
        self.meter.reset_peak()
        if self._trial >= len(self.candidates) and self.phase == "trial":
            fewer = self._fewer_pages(m)
            if fewer is not None:
                self.candidates.append(fewer)
        if len(self.candidates) > 1 and self._trial < len(self.candidates):
            self.current = self._refit(self.candidates[self._trial], m)
            return self.current
        return self._settle(m)

    def _fewer_pages(self, m: Measured) -> Choice | None:
        """Once, when every paging trial lost to paging nothing: a trial with half the pages of the
        smallest one tried. The planned count assumes the copies hide behind compute at LINK_SHARE of
        the link; where every trial paging many blocks lost to recomputing them (seen with a 14B LoRA at
        1 x 2048, docs/benchmarks.md), fewer pages may still beat recomputing."""
        if self._refined or not (self.page and self.recompute):
            return None
        self._refined = True
        timed = {}
        for c, seconds, _peak in self._fitting_trials():
            timed[len(c.paged)] = min(seconds, timed.get(len(c.paged), seconds))
        paging = sorted(n for n in timed if n > 0)
        if 0 not in timed or not paging or any(timed[n] < timed[0] for n in paging):
            return None
        half = paging[0] // 2
        if half < 1:
            return None
        self._event(f"paging {paging[0]} blocks lost to paging none ({fmt_seconds(timed[paging[0]])} against "
                    f"{fmt_seconds(timed[0])}): one more trial pages {half}")
        return choose(m, page=self.page, recompute=self.recompute, paged=half)

    def _prune(self, m: Measured) -> None:
        best = min(t[1] for t in self.trials)
        left = []
        for c in self.candidates[self._trial:]:
            pages = len(c.paged) * m.block_bytes  # out in forward, back in backward beside the reserved bytes
            floor = max(2 * pages, pages + m.reserved_link_bytes) / m.link_bytes_per_s
            if floor >= best:
                self._event(f"not tried: {self.describe(c)}: its pages alone would take {fmt_seconds(floor)} "
                            f"on the link, the best step so far took {fmt_seconds(best)}")
            else:
                left.append(c)
        self.candidates = self.candidates[:self._trial] + left

    def _refit(self, candidate: Choice, m: Measured) -> Choice:
        """The candidate's share of paged blocks with the kept count the corrected room allows."""
        return choose(m, page=self.page, recompute=self.recompute, paged=len(candidate.paged))

    def _fitting_trials(self) -> list[tuple[Choice, float, int]]:
        """The trials whose peak stayed within the budget."""
        budget = self.meter.budget()
        return [t for t in self.trials if budget is None or t[2] <= budget]

    def _settle(self, m: Measured) -> Choice:
        best = min(self._fitting_trials() or self.trials, key=lambda t: t[1])[0] if self.trials else self.candidates[0]
        self.current = self._refit(best, m)
        self.phase = "settled"
        timings = ", ".join(f"{self.describe(c)} {fmt_seconds(s)}" for c, s, _ in self.trials)
        left = (f"; {fmt_bytes(self.vram_left_for_state)} of VRAM left for the optimizer state, which moves there next"
                if self.vram_left_for_state else "")
        self._event(f"settled: {self.describe(self.current)}" + (f" (measured: {timings})" if timings else "") + left)
        return self.current

    # ---- watchdog ----------------------------------------------------------------------------

    def _back_off(self, retries: int) -> Choice | None:
        """A settled step ran at the cap (the allocator freed its cache and retried, synchronizing the
        GPU each time): half the kept blocks recompute or page from the next step on. A step near the
        cap took about 1.5x as long as one with every block recomputed (measured: docs/benchmarks.md)."""
        before = self.current
        kept = len(before.kept)
        if kept == 0:
            return None
        m = self.measured
        m = self.measured = Measured(**{**m.__dict__, "room_bytes": (kept // 2) * max(m.block_bytes, 1)})
        self.current = choose(m, page=self.page, recompute=self.recompute, paged=len(before.paged))
        self.cap_backoffs += 1
        self._event(f"at the cap: the allocator ran out of cached VRAM {retries} times in the last step and "
                    f"synchronized the GPU each time; {self.describe(self.current)} (was: {self.describe(before)})")
        return self.current

    def forward_tokens(self, tokens: int) -> Choice | None:
        """Before a forward of `tokens` tokens: the setting to use instead (None: unchanged). Records
        the first count seen; once settled, a count above the measured one re-chooses for it."""
        if tokens <= 0:
            return None
        if self.tokens is None:
            self.tokens = tokens
            return None
        budget = self.meter.budget()
        if not self.settled or tokens <= self.tokens or budget is None or self.measured is None:
            return None
        scale = tokens / self.tokens
        m = self.measured
        base = self.static_bytes + int((self.base_bytes - self.static_bytes) * scale)
        limit = int(budget * (1 - PEAK_MARGIN))
        if base > limit:
            raise BatchRefused(
                f"a forward of {tokens} tokens ({scale:.2f}x the {self.tokens} measured) would need about "
                f"{fmt_bytes(base)} besides the blocks' saved activations ({fmt_bytes(self.static_bytes)} allocated "
                f"before the forward, the rest scaled with the tokens), over the {fmt_bytes(limit)} budget even "
                f"with every block recomputed; nothing ran. Use at most "
                f"about {self._tokens_that_fit(limit)} tokens per forward, or free VRAM (param_offload=, "
                f"quantize=, a chunked loss)")
        grown = Measured(**{**m.__dict__, "block_bytes": int(m.block_bytes * scale),
                            "room_bytes": max(0, limit - base)})
        choice = choose(grown, page=self.page, recompute=self.recompute, paged=len(self.current.paged))
        before = self.current
        self.measured, self.base_bytes, self.tokens = grown, base, tokens
        if len(choice.kept) >= len(before.kept):
            return None
        self.current = choice
        self._event(f"watchdog: a forward of {tokens} tokens ({scale:.2f}x the measured {int(tokens / scale)}) "
                    f"would save {fmt_bytes(grown.block_bytes)} per block: {self.describe(choice)} "
                    f"(was: {self.describe(before)})")
        return choice

    def static_grew(self, nbytes: int) -> None:
        """``nbytes`` more now live in VRAM across steps (the optimizer state moved there): the
        watchdog's base and the room for kept activations account for them from now on."""
        if nbytes <= 0:
            return
        self.base_bytes += nbytes
        self.static_bytes += nbytes
        left = min(nbytes, self.vram_left_for_state)  # the room already excluded this much
        self.vram_left_for_state -= left
        if self.measured is not None:
            self.measured = Measured(**{**self.measured.__dict__,
                                        "room_bytes": max(0, self.measured.room_bytes - (nbytes - left))})

    def _tokens_that_fit(self, limit: int) -> int:
        """Tokens per forward whose scaled base fits ``limit`` (the measured count when nothing scales)."""
        dynamic = self.base_bytes - self.static_bytes
        if dynamic <= 0:
            return self.tokens
        return max(1, int(self.tokens * (limit - self.static_bytes) / dynamic))

    def describe(self, choice: Choice) -> str:
        return (f"{len(choice.kept)} blocks keep their activations in VRAM, {len(choice.paged)} page them to "
                f"host memory, {len(choice.recomputed)} recompute them")
