"""activation_offload='auto' / recompute='auto': the rules (choose) and the measuring state machine,
driven on the CPU by a fake device (a VRAM budget, a clock charged per policy)."""

from __future__ import annotations

import pytest
import torch
import trainstream
import ts_pinned
from hypothesis import given, settings
from hypothesis import strategies as st
from test_activations import Stack, _run
from trainstream.activations import policy as activations_module
from trainstream.activations.autotune import Meter
from trainstream.activations.tuner import Measured, choose, spread, trial_candidates

measured = st.builds(
    Measured,
    blocks=st.integers(1, 64),
    block_bytes=st.integers(0, 1 << 30),
    forward_s=st.floats(1e-5, 1.0),
    link_bytes_per_s=st.floats(1e6, 1e11),
    room_bytes=st.integers(0, 1 << 36),
    host_bytes=st.integers(0, 1 << 38),
    reserved_link_bytes=st.integers(0, 1 << 34),
)


@settings(max_examples=300, deadline=None)
@given(measured, st.integers(0, 1 << 36), st.booleans(), st.booleans())
def test_more_room_never_pages_or_recomputes_more(m, extra, page, recompute):
    small = choose(m, page=page, recompute=recompute)
    large = choose(Measured(**{**m.__dict__, "room_bytes": m.room_bytes + extra}), page=page, recompute=recompute)
    assert len(large.kept) >= len(small.kept)
    assert len(large.paged) <= len(small.paged)
    assert len(large.recomputed) <= len(small.recomputed)


@settings(max_examples=300, deadline=None)
@given(measured, st.booleans(), st.booleans())
def test_every_block_gets_one_policy_within_the_limits(m, page, recompute):
    c = choose(m, page=page, recompute=recompute)
    assert sorted(c.kept + c.paged + c.recomputed) == list(range(m.blocks))
    if m.block_bytes > 0:
        assert len(c.paged) * m.block_bytes <= m.host_bytes  # pages fit in host memory
        kept_fit = m.room_bytes // m.block_bytes
        # Only blocks that may go nowhere are kept beyond the room.
        assert len(c.kept) <= max(kept_fit, 0) or not (page and recompute) or not recompute
    if not page:
        assert not c.paged
    if not recompute:
        assert not c.recomputed
    # The kept blocks are the latest ones when anything else happens: backward reaches them first.
    if c.kept and (c.paged or c.recomputed):
        assert min(c.kept) > max(c.paged + c.recomputed) or not recompute


@given(st.integers(0, 50), st.integers(1, 50))
def test_spread_picks_distinct_indices_in_range(count, among):
    picked = spread(min(count, among), among)
    assert len(picked) == min(count, among) and all(0 <= i < among for i in picked)


def test_trials_are_distinct_and_start_with_the_plan():
    m = Measured(blocks=8, block_bytes=100, forward_s=0.01, link_bytes_per_s=1e3, room_bytes=250, host_bytes=10**6)
    options = trial_candidates(m, page=True, recompute=True)
    assert options[0] == choose(m)
    assert len(set(options)) == len(options) >= 2
    assert options[0].kept == (6, 7)  # 250 bytes hold two blocks: the last two


class FakeDevice(Meter):
    """VRAM `budget`; the peak is what the policy in effect keeps plus a `tail`; synchronize()
    advances the clock by a block's forward during the probe, else by the step's cost."""

    def __init__(self, block_bytes, budget_blocks=1.5, recompute_s=3.0, page_s=1.0, link=1e15, page_cost=None):
        super().__init__(budget=int((1 + budget_blocks) * block_bytes), link_bytes_per_s=link, host_bytes=1 << 40)
        self.block_bytes, self.recompute_s, self.page_s = block_bytes, recompute_s, page_s
        self.page_cost = page_cost or (lambda pages: page_s * pages)  # seconds for a step paging `pages` blocks
        self.policy = None  # the ActivationPolicy, set once wrapped
        self.t = 0.0

    def allocated(self):
        return 0

    def peak(self):
        return (1 + len(self.policy.tuner.current.kept)) * self.block_bytes  # tail = one block

    def synchronize(self):
        tuner = self.policy.tuner
        if tuner.phase == "probe":
            self.t += 0.01
        else:
            c = tuner.current
            self.t += 1.0 + self.recompute_s * len(c.recomputed) + self.page_cost(len(c.paged))

    def now(self):
        return self.t


def _block_bytes():
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3, activation_offload=[0], min_offload_bytes=0)
    _run(model, opt, steps=1)
    nbytes = trainstream.memory_report(model)["activations"]["block_bytes"][0]
    trainstream.unwrap(model)
    return nbytes


@pytest.fixture
def fake_device(monkeypatch):
    made = []

    def install(**kwargs):
        device = FakeDevice(_block_bytes(), **kwargs)
        monkeypatch.setattr(activations_module, "Meter", lambda: device)
        made.append(device)
        return device

    return install


@pytest.mark.parametrize(("recompute_s", "page_s", "settled", "trials"), [
    (3.0, 1.0, ["offload", "offload", "offload", "keep"], 2),  # paging measures faster
    # recompute measures faster, and so does the one trial paging half as many (1 of 3)
    (1.0, 3.0, ["recompute", "recompute", "recompute", "keep"], 3),
])
def test_auto_probes_tries_and_settles_on_the_fastest_and_trains_bit_exact(fake_device, recompute_s, page_s, settled,
                                                                            trials):
    device = fake_device(recompute_s=recompute_s, page_s=page_s)
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3, min_offload_bytes=0)
    policy = model._trainstream_session.activations
    device.policy = policy
    losses = _run(model, opt, steps=6)
    report = trainstream.memory_report(model)["activations"]
    assert report["tuning"]["phase"] == "settled"
    assert report["policy"] == settled
    assert len(report["tuning"]["trials"]) == trials  # the plan (page all that do not fit), all recomputed
    events = [e for e in trainstream.memory_report(model)["events"] if "activations" in e]
    assert any("probe: one block saves" in e for e in events) and any("settled:" in e for e in events)
    trainstream.unwrap(model)

    plain, plain_opt = trainstream.wrap(Stack(depth=4), lr=1e-3, activation_offload=False, recompute=False)
    assert losses == _run(plain, plain_opt, steps=6)  # paging and recompute are exact
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)


def test_when_paging_all_loses_one_trial_pages_half_and_can_win(fake_device):
    """Pages that the link hides cost little, more cost much (copies no longer overlap compute): paging
    the 3 blocks that do not fit loses to recomputing them, paging 1 of them wins."""
    device = fake_device(recompute_s=1.0, page_cost=lambda pages: 0.1 * pages if pages <= 1 else 10.0 * pages)
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3, min_offload_bytes=0)
    device.policy = model._trainstream_session.activations
    losses = _run(model, opt, steps=6)
    report = trainstream.memory_report(model)
    tuning = report["activations"]["tuning"]
    assert [t["policy"].count("offload") for t in tuning["trials"]] == [0, 3, 1]
    assert report["activations"]["policy"] == ["recompute", "offload", "recompute", "keep"]
    assert any("one more trial pages 1" in e for e in report["events"])
    trainstream.unwrap(model)
    plain, plain_opt = trainstream.wrap(Stack(depth=4), lr=1e-3, activation_offload=False, recompute=False)
    assert losses == _run(plain, plain_opt, steps=6)


def test_auto_never_uses_a_path_set_to_false(fake_device):
    device = fake_device(recompute_s=0.1, page_s=5.0)  # recompute would win, but it is off
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3, recompute=False, min_offload_bytes=0)
    device.policy = model._trainstream_session.activations
    _run(model, opt, steps=5)
    report = trainstream.memory_report(model)["activations"]
    assert report["recompute_blocks"] == [] and report["policy"] == ["offload", "offload", "offload", "keep"]
    trainstream.unwrap(model)


def test_auto_on_the_cpu_keeps_everything_and_says_why():
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3)
    _run(model, opt, steps=2)
    report = trainstream.memory_report(model)
    assert report["activations"]["policy"] == ["keep"] * 4
    assert any("'auto' keeps every block's activations: the model trains on the CPU" in e for e in report["events"])
    trainstream.unwrap(model)


def test_an_explicit_choice_turns_the_other_auto_off():
    model, _ = trainstream.wrap(Stack(depth=4), lr=1e-3, recompute=[1])
    report = trainstream.memory_report(model)
    assert report["activations"]["policy"] == ["keep", "recompute", "keep", "keep"]
    assert any("the other option names its blocks explicitly" in e for e in report["events"])
    trainstream.unwrap(model)


def test_recompute_alone_measures_block_0_in_vram_and_recomputes_what_does_not_fit(fake_device):
    device = fake_device(recompute_s=3.0, page_s=0.1)  # paging would win, but it is off
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3, activation_offload=False, min_offload_bytes=0)
    policy = model._trainstream_session.activations
    device.policy = policy
    _run(model, opt, steps=4)
    assert policy.tuner.measured.block_bytes == device.block_bytes  # counted without paging
    report = trainstream.memory_report(model)["activations"]
    assert report["policy"] == ["recompute", "recompute", "recompute", "keep"]
    assert report["paging"]["pages"] == 0
    trainstream.unwrap(model)


def test_auto_recomputes_whole_blocks_even_when_selective_is_asked(fake_device):
    """The tuner prices a recomputed block at its inputs; a selective one keeps its matmul outputs too
    (the 14B LoRA at 1 x 2048 ran out of VRAM in its probe step on the H200): 'auto' uses 'full'."""
    device = fake_device(recompute_s=1.0, page_s=3.0)
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3, min_offload_bytes=0, recompute_variant="selective")
    policy = model._trainstream_session.activations
    device.policy = policy
    _run(model, opt, steps=4)
    assert policy._recompute and all(r.variant == "full" for r in policy._recompute.values())
    assert any("recompute='auto' recomputes whole blocks" in e for e in trainstream.memory_report(model)["events"])
    trainstream.unwrap(model)
    explicit, _ = trainstream.wrap(Stack(depth=4), lr=1e-3, recompute=[1, 2], recompute_variant="selective")
    assert {r.variant for r in explicit._trainstream_session.activations._recompute.values()} == {"selective"}
    trainstream.unwrap(explicit)


def test_a_paging_trial_the_link_cannot_win_is_not_run(fake_device):
    device = fake_device(recompute_s=3.0, page_s=0.1)
    device._link = device.block_bytes / 10.0  # 3 blocks out and back: 60 s on the link
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3, min_offload_bytes=0)
    device.policy = model._trainstream_session.activations
    _run(model, opt, steps=4)
    report = trainstream.memory_report(model)
    assert len(report["activations"]["tuning"]["trials"]) == 1
    assert report["activations"]["policy"] == ["recompute", "recompute", "recompute", "keep"]
    assert any("not tried: " in e for e in report["events"])
    assert report["activations"]["paging"]["pages"] <= 10  # block 0's probe pages only
    trainstream.unwrap(model)


@pytest.mark.parametrize(("reserved_blocks", "tried"), [(0.0, True), (8.0, False)])
def test_bytes_backward_already_moves_count_against_a_paging_trial(fake_device, reserved_blocks, tried):
    """Streamed weights and uploads share the link with pages coming back: the recompute trial steps
    in 10 s; 3 paged blocks take 6 s out and back alone (tried), or 3 + 8 s beside 8 blocks' worth of
    weights fetched for backward (not tried)."""
    device = fake_device(recompute_s=3.0, page_s=0.1)
    device._link = float(device.block_bytes)  # a block's bytes per second
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3, min_offload_bytes=0)
    policy = device.policy = model._trainstream_session.activations
    policy.reserved_link_bytes = lambda: int(reserved_blocks * device.block_bytes)
    _run(model, opt, steps=4)
    report = trainstream.memory_report(model)
    assert len(report["activations"]["tuning"]["trials"]) == (2 if tried else 1)
    assert any("not tried: " in e for e in report["events"]) is not tried
    trainstream.unwrap(model)


@pytest.mark.parametrize(("state_blocks", "kept", "left"), [(0.0, 3, 0.0), (1.5, 2, 1.5), (4.0, 3, 0.0)])
def test_kept_activations_leave_room_for_the_optimizer_state_when_it_fits(fake_device, state_blocks, kept, left):
    """Budget 5 blocks, 3% margin, 1 block of rest: 3 blocks' activations fit. A state of 1.5 blocks that
    moves to VRAM after settling leaves room for 2; one of 4 blocks never fits, so it takes no room."""
    device = fake_device(recompute_s=1.0, page_s=3.0, budget_blocks=4.0)
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3, min_offload_bytes=0)
    policy = device.policy = model._trainstream_session.activations
    state = int(state_blocks * device.block_bytes)
    policy.reserved_vram_bytes = lambda: state
    _run(model, opt, steps=6)
    tuner = policy.tuner
    assert tuner.settled and len(tuner.current.kept) == kept
    assert tuner.vram_left_for_state == int(left * device.block_bytes)
    settled = [e for e in trainstream.memory_report(model)["events"] if "settled:" in e]
    assert ("left for the optimizer state" in settled[-1]) is (left > 0)
    # The move itself then takes that room, not more of it.
    room = tuner.measured.room_bytes
    tuner.static_grew(state)
    assert tuner.measured.room_bytes == (room if left > 0 else max(0, room - state))
    trainstream.unwrap(model)


def test_a_losing_paging_trial_gives_its_page_pool_back(fake_device, monkeypatch):
    """Recompute measures faster: the slabs page-locked for the paging trial are returned at settle."""
    device = fake_device(recompute_s=1.0, page_s=3.0)
    arena = ts_pinned.PinnedArena(slab_bytes=64 << 10)  # small slabs, private: the pool's growth is visible
    monkeypatch.setattr(trainstream._session.ts_pinned, "default_arena", lambda: arena)
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3, min_offload_bytes=0)
    device.policy = model._trainstream_session.activations
    reserved = []
    for _ in range(6):
        _run(model, opt, steps=1)
        reserved.append(arena.stats()["arena_bytes"])
    report = trainstream.memory_report(model)
    assert report["activations"]["policy"] == ["recompute", "recompute", "recompute", "keep"]
    paging = report["activations"]["paging"]
    assert paging["pool_grown"] > 0 and paging["pool_released"] >= paging["pool_grown"] - (64 << 10)
    assert reserved[-1] == reserved[-2] < max(reserved)  # and the pool does not grow back
    assert any("released" in e and "page-locked" in e for e in report["events"])
    arena.check_invariants()
    trainstream.unwrap(model)


def test_the_watchdog_keeps_fewer_blocks_before_a_longer_batch_runs(fake_device):
    """Settled on 4 x 8 tokens; a 4 x 32 batch would save 4x per block: re-chosen before it runs."""
    device = fake_device(recompute_s=1.0, page_s=3.0, budget_blocks=4.0)
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3, min_offload_bytes=0)
    policy = model._trainstream_session.activations
    device.policy = policy
    _run(model, opt, steps=6)
    assert policy.tuner.settled
    kept_before = policy.policy().count("keep")
    x = torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(7))
    model(x).backward()
    opt.step()
    opt.zero_grad()
    events = [e for e in trainstream.memory_report(model)["events"] if "watchdog" in e]
    assert len(events) == 1 and "128 tokens (4.00x the measured 32)" in events[0]
    assert policy.policy().count("keep") < kept_before
    model(torch.randn(4, 8, 32)).backward()  # a shorter batch again: nothing changes back
    opt.step()
    assert len([e for e in trainstream.memory_report(model)["events"] if "watchdog" in e]) == 1
    trainstream.unwrap(model)


@pytest.mark.parametrize("static_blocks", [0.0, 3.0])
def test_a_batch_no_policy_fits_is_refused_before_it_runs_and_training_goes_on(fake_device, static_blocks):
    """The rest of the step (a block's worth at 32 tokens, as FakeDevice's tail) grows with the tokens,
    what was allocated before the forward does not: 4x the tokens needs 4 blocks' worth on top of it, over
    a budget of 4 (+static) blocks even with every block recomputed. Refused with the numbers, before any
    block runs; a measured-size batch then trains as before."""
    from trainstream.activations.autotune import BatchRefused

    device = fake_device(recompute_s=1.0, page_s=3.0, budget_blocks=3.0 + static_blocks)
    device.allocated = lambda: int(static_blocks * device.block_bytes)
    device.peak = lambda: int((1 + static_blocks + len(device.policy.tuner.current.kept)) * device.block_bytes)
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3, min_offload_bytes=0)
    policy = model._trainstream_session.activations
    device.policy = policy
    _run(model, opt, steps=6)
    assert policy.tuner.settled
    before = policy.policy()
    ran = []
    handle = policy.blocks[1].register_forward_pre_hook(lambda *_: ran.append(1))
    with pytest.raises(BatchRefused, match=r"a forward of 128 tokens \(4\.00x the 32 measured\).*nothing ran") as refused:
        model(torch.randn(4, 32, 32)).backward()
    assert isinstance(refused.value, MemoryError) and "at most about" in str(refused.value)
    assert ran == [] and policy.policy() == before
    handle.remove()
    model(torch.randn(4, 16, 32)).backward()  # 2x: fits once fewer blocks keep (the watchdog re-chooses)
    opt.step()
    opt.zero_grad()
    model(torch.randn(4, 8, 32)).backward()
    opt.step()
    assert policy.tuner.settled
    trainstream.unwrap(model)


def test_state_moved_to_vram_after_settling_counts_in_the_watchdog(fake_device):
    """offload='auto' moves the optimizer state to VRAM after the policy settled: the watchdog's base
    grows by it, so a longer forward that fitted before the move is refused after it."""
    from trainstream.activations.autotune import BatchRefused

    device = fake_device(recompute_s=1.0, page_s=3.0, budget_blocks=4.0)
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3, min_offload_bytes=0)
    policy = model._trainstream_session.activations
    device.policy = policy
    _run(model, opt, steps=6)
    tuner = policy.tuner
    assert tuner.settled
    room, base = tuner.measured.room_bytes, tuner.base_bytes
    tuner.static_grew(2 * device.block_bytes)
    assert tuner.base_bytes == base + 2 * device.block_bytes and tuner.static_bytes >= 2 * device.block_bytes
    assert tuner.measured.room_bytes == max(0, room - 2 * device.block_bytes)
    # 3x the tokens: 3 blocks' worth of tail on 2 of state, over the 4.85 the budget allows (without the
    # moved state, 3 blocks' worth would fit)
    with pytest.raises(BatchRefused):
        tuner.forward_tokens(3 * tuner.tokens)
    trainstream.unwrap(model)


class CapDevice(FakeDevice):
    """The fake device, with the allocator retrying (running out of cached VRAM) in every step that
    keeps more than `safe` blocks' activations."""

    safe = 0

    def alloc_retries(self):  # asked once at the end of each step: did the step just run retry?
        tuner = self.policy.tuner
        if tuner.current is not None and len(tuner.current.kept) > self.safe:
            self.retries += 1
        return self.retries


def test_a_settled_step_at_the_cap_keeps_fewer_blocks_after(monkeypatch):
    device = CapDevice(_block_bytes(), budget_blocks=3.5, recompute_s=1.0, page_s=3.0)
    monkeypatch.setattr(activations_module, "Meter", lambda: device)
    model, opt = trainstream.wrap(Stack(depth=8), lr=1e-3, min_offload_bytes=0)
    policy = model._trainstream_session.activations
    device.policy = policy
    device.safe = 99  # no retries while it measures and settles
    _run(model, opt, steps=5)
    report = trainstream.memory_report(model)["activations"]
    assert report["tuning"]["phase"] == "settled"
    kept = report["policy"].count("keep")
    assert kept >= 2 and report["tuning"]["cap_backoffs"] == 0
    device.safe = 0  # from now on every step that keeps a block runs at the cap
    _run(model, opt, steps=4)
    report = trainstream.memory_report(model)
    assert report["activations"]["policy"].count("keep") == 0
    assert report["activations"]["tuning"]["cap_backoffs"] >= 2  # halved, then halved again
    assert any("at the cap: the allocator ran out of cached VRAM" in e for e in report["events"])
    trainstream.unwrap(model)


def test_a_trial_at_the_cap_counts_as_not_fitting(monkeypatch):
    """The fastest trial ran with allocator retries: the settled setting is the other one."""
    device = CapDevice(_block_bytes(), recompute_s=3.0, page_s=1.0)  # paging is faster...
    monkeypatch.setattr(activations_module, "Meter", lambda: device)
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3, min_offload_bytes=0)
    device.policy = model._trainstream_session.activations
    device.safe = 99

    def paging_hits_the_cap():
        tuner = device.policy.tuner
        if tuner.phase == "trial" and tuner.current.paged:
            device.retries += 1  # ...but runs at the cap
        return device.retries

    device.alloc_retries = paging_hits_the_cap
    _run(model, opt, steps=6)
    report = trainstream.memory_report(model)
    assert report["activations"]["tuning"]["phase"] == "settled"
    assert report["activations"]["offloaded_blocks"] == []
    assert any("counted as not fitting" in e for e in report["events"])
    trainstream.unwrap(model)


def test_compiled_blocks_probe_try_and_settle_like_eager_without_graph_breaks(fake_device, fresh_dynamo):
    # 'auto' wraps every block for recompute; compile_blocks then compiles the forward inside that wrapper,
    # so the tuner's probe, its paging trials (saved-tensor hooks around the block) and the checkpoint all
    # run eagerly around one compiled graph, and dropout recomputes bit for bit.
    device = fake_device(recompute_s=1.0, page_cost=lambda pages: 0.1 * pages if pages <= 1 else 10.0 * pages)
    plain, plain_opt = trainstream.wrap(Stack(depth=4, p=0.2), lr=1e-3, activation_offload=False, recompute=False)
    expected = _run(plain, plain_opt, steps=6)  # before anything compiles (engine/guard.py)
    model, opt = trainstream.wrap(Stack(depth=4, p=0.2), lr=1e-3, min_offload_bytes=0)
    device.policy = model._trainstream_session.activations
    assert trainstream.compile_blocks(model, blocks=model.layers, backend="aot_eager") == [0, 1, 2, 3]
    losses = _run(model, opt, steps=6)
    counters = torch._dynamo.utils.counters
    assert counters["frames"]["ok"] > 0
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    report = trainstream.memory_report(model)["activations"]
    assert report["policy"] == ["recompute", "offload", "recompute", "keep"]
    assert report["paging"]["d2h_bytes"] > 0
    trainstream.unwrap(model)
    assert losses == expected


def test_a_trial_step_in_which_torch_compile_worked_is_timed_again(fake_device):
    # Compiled blocks compile at their first calls, inside the first trial steps: on the H200 the
    # recompute trial took 22.3 s with its compiles (about 1 s without) and paging won on that number.
    device = fake_device(recompute_s=1.0, page_s=3.0)  # recompute wins when timed fairly
    compiling = {"steps": 2, "count": 0}
    plain_sync = device.synchronize

    def synchronize():
        plain_sync()
        if device.policy.tuner.phase == "trial" and compiling["steps"] > 0:
            compiling["steps"] -= 1
            compiling["count"] += 1
            device.t += 100.0  # the compiler's time, charged to the step

    device.synchronize = synchronize
    device.compilations = lambda: compiling["count"]
    model, opt = trainstream.wrap(Stack(depth=4), lr=1e-3, min_offload_bytes=0)
    device.policy = model._trainstream_session.activations
    _run(model, opt, steps=8)
    report = trainstream.memory_report(model)
    assert report["activations"]["policy"] == ["recompute", "recompute", "recompute", "keep"]
    assert all(t["seconds"] < 100 for t in report["activations"]["tuning"]["trials"])
    assert sum("torch.compile compiled during the step" in e for e in report["events"]) == 2
    trainstream.unwrap(model)
