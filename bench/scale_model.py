"""The engine model behind ``python -m bench.scale``: one engine, stepped token by token.

An engine is a number of request slots and a decode step time that depends on how many
slots are busy. Requests of random length fill the slots and are replaced as they finish
(continuous batching). Weight updates arrive on a cadence and cost, by mode:

- ``pause`` (vLLM's pause(keep) + update, PipelineRL, TRL): the engine stops for the whole
  update, transfer and load; running requests keep their KV cache and resume;
- ``batch`` (batch-boundary sync): stop admitting, let every running request finish, stop
  for the update, refill;
- ``inflight`` (this project): the bytes are staged while the engine decodes, which takes
  ``stage_cost_s`` of decode time spread over the staging (shared HBM on a GPU; shared
  cores and GIL on the CPU), then one step boundary holds the commit, ``stall_s``.

The simulation is deterministic for a seed: requests draw their lengths from a
``random.Random(seed)`` in the order they are admitted, exactly as ``bench.inflight``
draws them, so the CPU benchmark can be replayed request for request.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from dataclasses import dataclass, field

UPDATE_MODES = ("none", "pause", "batch", "inflight")


@dataclass(frozen=True, kw_only=True)
class Lengths:
    """Generated tokens per request: ``uniform`` on [low, high] (``bench.inflight``'s draw), or
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

    ``every_steps`` (a cadence in engine steps, as ``bench.inflight`` has it) or ``every_s``
    (a new version every so many seconds, a trainer's step time). ``stall_s``: seconds the
    engine does not decode per update. In-flight only: ``stage_s``, how long staging runs
    beside decoding (the next version cannot start staging before the last committed), and
    ``stage_cost_s``, the decode time it takes meanwhile: each step is longer by the same
    fraction, ``stage_cost_s / stage_s``, and what a staging shorter than a step did not
    spend is paid at the commit."""

    mode: str
    every_steps: int = 0
    every_s: float = 0.0
    stall_s: float = 0.0
    stage_s: float = 0.0
    stage_cost_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in UPDATE_MODES:
            raise ValueError(f"Update.mode={self.mode!r} is not one of {UPDATE_MODES}")
        if self.mode != "none" and (self.every_steps > 0) == (self.every_s > 0):
            raise ValueError(f"Update({self.mode}): give exactly one of every_steps={self.every_steps}, every_s={self.every_s}")
        for name in ("stall_s", "stage_s", "stage_cost_s", "every_s", "every_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"Update.{name}={getattr(self, name)} must be >= 0")


@dataclass
class Run:
    """What one simulated engine did: tokens, seconds, updates, and the lag (versions
    committed between a token's step and the end of its request, as ``bench.inflight``
    counts it) of every token of every finished request."""

    tokens: int = 0
    wall_s: float = 0.0
    steps: int = 0
    updates: int = 0
    stall_s: float = 0.0
    lag_hist: dict[int, int] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)  # each step's duration, stalls excluded (``record``)

    def add(self, other: Run) -> None:
        self.tokens += other.tokens
        self.wall_s += other.wall_s
        self.steps += other.steps
        self.updates += other.updates
        self.stall_s += other.stall_s
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


def simulate(slots: int, step: StepTime, update: Update, lengths: Lengths, steps: int, seed: int = 0,
             warmup_steps: int = 0, record: bool = False) -> Run:
    """Step one engine ``steps`` times after ``warmup_steps`` unmeasured ones (which fill the
    slots with requests of every age, so the measurement starts in steady state).

    A request of length L admitted before step s yields one token at each of steps s .. s+L-1
    (the first comes with its prefill) and frees its slot after the last. An update's stall
    and a commit happen at a step boundary; a version committed before step c is the one
    every token from step c on is sampled by."""
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
                staging_until, pending, cost_left = t + update.stage_s, False, update.stage_cost_s
            elif due and update.every_s:
                pending = True
            if staging_until >= 0 and t >= staging_until:  # staged: commit at this boundary
                t += update.stall_s + cost_left
                run.stall_s += update.stall_s
                run.updates += 1
                commits.append(s)
                staging_until, cost_left = -1.0, 0.0
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
        if staging_until >= 0 and cost_left > 0:
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
