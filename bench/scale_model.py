"""The engine model behind ``python -m inflight.bench.scale``: one engine, stepped token by token.

An engine is a number of request slots and a decode step time that depends on how many
slots are busy. Requests of random length fill the slots and are replaced as they finish
(continuous batching). Weight updates arrive on a cadence and cost, by mode:

- ``pause`` (vLLM's pause(keep) + update, PipelineRL, TRL): the engine stops for the whole
  update, transfer and load; running requests keep their KV cache and resume;
- ``batch`` (batch-boundary sync): stop admitting, let every running request finish, stop
  for the update, refill;
- ``inflight`` (this project): the bytes are staged while the engine decodes, which takes
  ``stage_cost_s`` of decode time spread over the staging (shared HBM on a GPU; shared
  cores and GIL on the CPU), then one step boundary holds the commit, ``stall_s``;
- ``layer`` (in-flight, ``commit_unit="layer"``): the same staging, one layer group at a
  time: the trainer sends a group once a staging slot is free (``staged_groups`` of them),
  and each group commits at the first step boundary after it is ready, one group per
  boundary, with a stall of its own (``group_stall_s``).

The simulation is deterministic for a seed: requests draw their lengths from a
``random.Random(seed)`` in the order they are admitted, exactly as ``inflight.bench.inflight``
draws them, so the CPU benchmark can be replayed request for request.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from dataclasses import dataclass, field

UPDATE_MODES = ("none", "pause", "batch", "inflight", "layer")


@dataclass(frozen=True, kw_only=True)
class Lengths:
    """Generated tokens per request: ``uniform`` on [low, high] (``inflight.bench.inflight``'s draw), or
    ``lognormal`` with the given median and sigma, capped at ``high`` (RL rollouts: a long tail
    up to the generation limit)."""

    dist: str = "uniform"
    low: int = 16
    high: int = 512
    median: float = 0.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if self.dist not in ("uniform", "lognormal"):
            raise ValueError(f"Lengths.dist={self.dist!r} is not uniform or lognormal")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"Lengths.low={self.low}, high={self.high}: need 1 <= low <= high")
        if self.dist == "lognormal" and not (self.median >= 1 and self.sigma > 0):
            raise ValueError(f"Lengths: lognormal needs median >= 1 and sigma > 0, got {self.median}, {self.sigma}")

    def draw(self, rng: random.Random) -> int:
        if self.dist == "uniform":
            return rng.randint(self.low, self.high)
        return min(self.high, max(self.low, round(rng.lognormvariate(math.log(self.median), self.sigma))))

    def moments(self, n: int = 20000) -> tuple[float, float]:
        """(mean length, mean age of a running request) = (E[L], E[L^2] / 2E[L]): a slot that is
        refilled as it empties spends its time in long requests (renewal theory), so the KV a
        running request holds on average is the second number, not half the first."""
        if self.dist == "uniform":  # exact: integers low..high, equally likely
            n_values = self.high - self.low + 1
            m1 = (self.low + self.high) / 2
            return m1, ((n_values**2 - 1) / 12 + m1 * m1) / (2 * m1)
        rng = random.Random(12345)
        xs = [self.draw(rng) for _ in range(n)]
        m1 = sum(xs) / n
        return m1, sum(x * x for x in xs) / n / (2 * m1)

    def scaled(self, factor: float) -> Lengths:
        """The same shape with every length times ``factor`` (for the crossover sweeps)."""
        return Lengths(dist=self.dist, low=max(1, round(self.low * factor)), high=max(1, round(self.high * factor)),
                       median=self.median * factor, sigma=self.sigma)


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Seconds per decode step with b running requests:
    ``overhead + max(min(weights_max, weights_per_seq * b) + kv_per_seq * b, flops_per_seq * b)``.

    On a GPU decode is a roofline: every step reads the weights the batch touches (all of a
    dense model; for an MoE, more experts the larger the batch, up to all of them) and each
    request's KV cache, unless the matmuls' FLOPs take longer. On the CPU it is the straight
    line through two measured points (``weights_*`` = intercept, ``kv_per_seq`` = slope)."""

    overhead_s: float = 0.0
    weights_max_s: float = 0.0
    weights_per_seq_s: float = 0.0
    kv_per_seq_s: float = 0.0
    flops_per_seq_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("overhead_s", "weights_max_s", "weights_per_seq_s", "kv_per_seq_s", "flops_per_seq_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"StepTime.{name}={getattr(self, name)} must be >= 0")

    def scaled(self, k: float) -> StepTime:
        """The same engine on a machine ``k`` times slower."""
        return StepTime(overhead_s=k * self.overhead_s, weights_max_s=k * self.weights_max_s,
                        weights_per_seq_s=k * self.weights_per_seq_s, kv_per_seq_s=k * self.kv_per_seq_s,
                        flops_per_seq_s=k * self.flops_per_seq_s)

    def __call__(self, b: int) -> float:
        memory = min(self.weights_max_s, self.weights_per_seq_s * b) + self.kv_per_seq_s * b
        return self.overhead_s + max(memory, self.flops_per_seq_s * b)


@dataclass(frozen=True, kw_only=True)
class Update:
    """How one mode updates the weights, and how often.

    ``every_steps`` (a cadence in engine steps, as ``inflight.bench.inflight`` has it) or ``every_s``
    (a new version every so many seconds, a trainer's step time). ``stall_s``: seconds the
    engine does not decode per update. In-flight only: ``stage_s``, how long staging runs
    beside decoding (the next version cannot start staging before the last committed), and
    ``stage_cost_s``, the decode time it takes meanwhile: each step is longer by the same
    fraction, ``stage_cost_s / stage_s``, and what a staging shorter than a step did not
    spend is paid at the commit.

    Layer only, per group in commit order: ``group_stall_s``, its commit's stall (``stall_s``
    is their sum, the stall of a whole update); ``group_stage_s``, its time on the link
    (their sum is ``stage_s``); ``group_ready_s``, what it waits after landing before it can
    commit (host staging: its copy into a device slot; empty: nothing); at most
    ``staged_groups`` groups sent and not yet committed."""

    mode: str
    every_steps: int = 0
    every_s: float = 0.0
    stall_s: float = 0.0
    stage_s: float = 0.0
    stage_cost_s: float = 0.0
    group_stall_s: tuple[float, ...] = ()
    group_stage_s: tuple[float, ...] = ()
    group_ready_s: tuple[float, ...] = ()
    staged_groups: int = 2

    def __post_init__(self) -> None:
        if self.mode not in UPDATE_MODES:
            raise ValueError(f"Update.mode={self.mode!r} is not one of {UPDATE_MODES}")
        if self.mode != "none" and (self.every_steps > 0) == (self.every_s > 0):
            raise ValueError(f"Update({self.mode}): give exactly one of every_steps={self.every_steps}, "
                             f"every_s={self.every_s}")
        for name in ("stall_s", "stage_s", "stage_cost_s", "every_s", "every_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"Update.{name}={getattr(self, name)} must be >= 0")
        if self.mode == "layer":
            self._check_groups()

    def _check_groups(self) -> None:
        """A layer update's groups: one stall and one link time each (and a ready time, if any),
        none negative, adding up to the update's ``stall_s`` and ``stage_s``."""
        n = len(self.group_stall_s)
        if n < 1 or len(self.group_stage_s) != n or len(self.group_ready_s) not in (0, n) or self.staged_groups < 1:
            raise ValueError(f"Update(layer): {n} group stalls, {len(self.group_stage_s)} link times, "
                             f"{len(self.group_ready_s)} ready times, staged_groups={self.staged_groups}: need "
                             f"n >= 1 of each (ready times optional) and staged_groups >= 1")
        if min(self.group_stall_s + self.group_stage_s + self.group_ready_s) < 0:
            raise ValueError("Update(layer): a group's stall, link or ready time is negative")
        for total, parts in (("stall_s", self.group_stall_s), ("stage_s", self.group_stage_s)):
            if not math.isclose(getattr(self, total), sum(parts), rel_tol=1e-9, abs_tol=1e-12):
                raise ValueError(f"Update(layer).{total}={getattr(self, total)} is not its groups' sum {sum(parts)}")


@dataclass
class Run:
    """What one simulated engine did: tokens, seconds, updates, and the lag (versions
    committed between a token's step and the end of its request, as ``inflight.bench.inflight``
    counts it) of every token of every finished request. In-flight modes: ``commits``, the
    step boundaries that held a commit (a layer update holds one per group), and ``span_s``,
    the seconds from each update's start to the end of its last commit, summed."""

    tokens: int = 0
    wall_s: float = 0.0
    steps: int = 0
    updates: int = 0
    stall_s: float = 0.0
    commits: int = 0
    span_s: float = 0.0
    lag_hist: dict[int, int] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)  # each step's duration, stalls excluded (``record``)

    def add(self, other: Run) -> None:
        self.tokens += other.tokens
        self.wall_s += other.wall_s
        self.steps += other.steps
        self.updates += other.updates
        self.stall_s += other.stall_s
        self.commits += other.commits
        self.span_s += other.span_s
        self.step_s += other.step_s
        for k, v in other.lag_hist.items():
            self.lag_hist[k] = self.lag_hist.get(k, 0) + v

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def lag_quantile(self, q: float) -> int:
        total, seen = sum(self.lag_hist.values()), 0
        for lag in sorted(self.lag_hist):
            seen += self.lag_hist[lag]
            if seen >= q * total:
                return lag
        return 0

    @property
    def lag_mean(self) -> float:
        total = sum(self.lag_hist.values())
        return sum(k * v for k, v in self.lag_hist.items()) / total if total else 0.0


class _Groups:
    """A layer update under way: the trainer sends group i once group i - ``staged_groups``
    committed (the engine's commits pace it), one group at a time on the link; each is ready
    when it landed and its ready time (one device copy after another) passed, and commits at
    the first step boundary after that, one group per boundary, in order."""

    def __init__(self, update: Update) -> None:
        self.u = update
        self.ready: list[float] = []  # when each group sent so far can commit
        self.committed = -1  # groups committed; -1: no update under way
        self.link_free = self.copy_free = 0.0

    @property
    def busy(self) -> bool:
        return self.committed >= 0

    def start(self, t: float) -> None:
        self.ready, self.committed, self.link_free, self.copy_free = [], 0, t, t
        self._send(t)

    def _send(self, t: float) -> None:
        """Fill the free staging slots at time ``t``."""
        u = self.u
        while len(self.ready) < len(u.group_stall_s) and len(self.ready) - self.committed < u.staged_groups:
            i = len(self.ready)
            self.link_free = max(self.link_free, t) + u.group_stage_s[i]
            self.copy_free = max(self.link_free, self.copy_free) + (u.group_ready_s[i] if u.group_ready_s else 0.0)
            self.ready.append(self.copy_free)

    def boundary(self, t: float) -> tuple[float, bool] | None:
        """At a step boundary at time ``t``: commit the next group if it is ready. Returns its
        stall and whether it was the update's last group, or None (no commit here)."""
        i = self.committed
        if i < 0 or i >= len(self.ready) or self.ready[i] > t:
            return None
        stall = self.u.group_stall_s[i]
        self.committed += 1
        if self.committed == len(self.u.group_stall_s):
            self.committed = -1
            return stall, True
        self._send(t + stall)  # the slot is free once the copy is done
        return stall, False


def simulate(slots: int, step: StepTime, update: Update, lengths: Lengths, steps: int, seed: int = 0,
             warmup_steps: int = 0, record: bool = False) -> Run:
    """Step one engine ``steps`` times after ``warmup_steps`` unmeasured ones (which fill the
    slots with requests of every age, so the measurement starts in steady state).

    A request of length L admitted before step s yields one token at each of steps s .. s+L-1
    (the first comes with its prefill) and frees its slot after the last. An update's stall
    and a commit happen at a step boundary; a version committed before step c is the one
    every token from step c on is sampled by. A layer update's version counts from its last
    group's commit: a token sampled by a hybrid lags from the hybrid's oldest group, as the
    engine's labels count it (``inflight.layer_groups``)."""
    if slots < 1:
        raise ValueError(f"simulate: slots={slots} must be >= 1")
    rng = random.Random(seed)
    running: list[tuple[int, int]] = []  # (last step, first step) of each running request
    commits: list[int] = []  # steps before which a new version went live
    run = Run()
    t = 0.0
    next_due_t = update.every_s
    staging_until = -1.0  # in-flight: wall time staging of the pushed version ends; -1: idle
    cost_left = 0.0  # in-flight: decode time the staging still takes
    rate = update.stage_cost_s / update.stage_s if update.stage_s > 0 else 0.0
    pending = False  # in-flight, time cadence: a version came out while the last was staging
    groups = _Groups(update)  # layer: the update under way
    started = 0.0  # in-flight: when the update under way started
    draining = False
    for s in range(warmup_steps + steps):
        if s == warmup_steps:  # measurement starts: forget the warm-up's time and tokens
            t, run, next_due_t, commits = 0.0, Run(), update.every_s, []
        measured = s - warmup_steps
        due = False
        if update.mode != "none" and measured >= 0:
            if update.every_steps:
                due = measured > 0 and measured % update.every_steps == 0
            elif t >= next_due_t:
                due = True
                next_due_t += update.every_s * max(1, math.floor((t - next_due_t) / update.every_s) + 1)
        if update.mode == "pause" and due:
            t += update.stall_s
            run.stall_s += update.stall_s
            run.updates += 1
            commits.append(s)
        elif update.mode == "inflight":
            # A trainer pushes its newest version as soon as the last one landed; the CPU
            # benchmark's driver instead waits for its next cue (step cadence), as modelled.
            if (due or pending) and staging_until < 0:
                staging_until, pending, cost_left, started = t + update.stage_s, False, update.stage_cost_s, t
            elif due and update.every_s:
                pending = True
            if staging_until >= 0 and t >= staging_until:  # staged: commit at this boundary
                t += update.stall_s + cost_left
                run.stall_s += update.stall_s
                run.updates += 1
                run.commits += 1
                run.span_s += t - started
                commits.append(s)
                staging_until, cost_left = -1.0, 0.0
        elif update.mode == "layer":
            if (due or pending) and not groups.busy:
                groups.start(t)
                pending, cost_left, started = False, update.stage_cost_s, t
            elif due and update.every_s:
                pending = True
            if (done := groups.boundary(t)) is not None:  # a group commits at this boundary
                stall, last = done
                t += stall + (cost_left if last else 0.0)
                run.stall_s += stall
                run.commits += 1
                if last:  # the version is whole: tokens from here on are sampled by it alone
                    run.updates += 1
                    run.span_s += t - started
                    commits.append(s)
                    cost_left = 0.0
        elif update.mode == "batch":
            draining = draining or due
            if draining and not running:
                t += update.stall_s
                run.stall_s += update.stall_s
                run.updates += 1
                commits.append(s)
                draining = False
        while not draining and len(running) < slots:
            heapq.heappush(running, (s + lengths.draw(rng) - 1, s))
        b = len(running)
        dt = step(b) if b else step(1)
        if (staging_until >= 0 or groups.busy) and cost_left > 0:
            extra = min(dt * rate, cost_left)
            dt, cost_left = dt + extra, cost_left - extra
        t += dt
        if record:
            run.step_s.append(dt)
        run.tokens += b
        run.steps += 1
        while running and running[0][0] == s:
            last, first = heapq.heappop(running)
            if measured >= 0:
                _add_lags(run.lag_hist, first, last, commits)
    run.wall_s = t
    return run


def _add_lags(hist: dict[int, int], first: int, last: int, commits: list[int]) -> None:
    """Lag of each token of a request that ran steps first..last: the commits after its step
    and up to the request's last step (those before step c <= last, c > token step)."""
    lo = bisect.bisect_right(commits, first)
    hi = bisect.bisect_right(commits, last)
    inside = commits[lo:hi]
    edges = [first] + inside + [last + 1]
    for j in range(len(edges) - 1):
        n = edges[j + 1] - edges[j]
        if n > 0:
            lag = len(inside) - j
            hist[lag] = hist.get(lag, 0) + n
