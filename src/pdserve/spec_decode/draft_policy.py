"""How many drafts a speculative step verifies: the adaptive choice (``0..k`` per step).

A verify step of ``B`` requests with ``j`` drafts each costs ``cost(B, j)`` (the target's
forward over ``B * (1 + j)`` rows plus the drafting the step does), and each request
gains, in expectation,

    E(j) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_j

tokens, where ``a_m`` is the chance that draft ``m`` is accepted given that drafts
``1 .. m-1`` were (acceptance stops at the first rejection). The policy picks the ``j``
with the most tokens per second, ``E(j) / cost(B, j)``, so with the costs measured on the
device speculation is never chosen where it costs more than it gives: ``j = 0`` (plain
decode) is always a candidate. ``k`` (``num_speculative_tokens``) is the ceiling.

**Costs** come from the runner, which times every CUDA graph it captured (target and
draft graphs; :meth:`DraftPolicy.set_costs`) for each padded batch size, query length and
context width. A step runs at the next captured size above its batch and the narrowest
captured width its longest context fits, so it takes that graph's costs. With no costs
known for it (a CPU engine, graphs off, a batch past the largest captured size) the
policy keeps ``k``.

**Measured step times** replace the graph timings once a shape has run: the scheduler
reports each landed decode/verify step of a uniform ``(batch, 1 + j)`` shape with the time
it took (:meth:`DraftPolicy.observe_cost`: on CUDA the device's time, from CUDA events,
the real batch's routing, contexts and host-side gaps included; elsewhere the host's
clock), and the median of a shape's last ``COST_WINDOW`` times stands in for its graph
timing once it has ``COST_MIN_OBS`` of them. A time outside ``COST_BAND`` graph timings is
not kept: it was not that step alone (H100 run 78, timed on the host's clock: a ``j = 0``
step at batch 1 "took" 32.9 ms against 6.5 ms, and the policy, which then never chose
``j = 0`` again, never corrected it). A ``j`` whose graph timing was too
optimistic is thus chosen a few times, measured, and dropped if it does not pay (H100 run
70: at 128 streams x 16K and acceptance 0.5 the graph timings made ``j = 2`` the choice;
its steps took 42 ms against 31 for ``j = 1``, 5% slower than no speculation). A time older
than ``COST_STALE`` choices is forgotten, so the shape is measured again.

**Neighbouring sizes**: a graph timing is off by much the same factor at nearby batch
sizes (the same kernels on a few more or fewer rows), so where ``j`` has no measurement
at a step's size, its graph timing is scaled by ``measured / graph`` of ``j`` at the
nearest size of the same width that has one. Without it every size a shrinking batch
passes through (streams end at different steps) started again from the graph timings
(H200 run 138, 208 streams x 16K at 0.7: ``j = 2``, whose graph timing was 7% optimistic
at the full size, ran 22 of 58 steps where ``j = 1`` paid best).

**Measuring the rivals**: graph timings are off both ways (warm-up's dummy batches route
the MoE unlike real traffic: H100 run 83, at 128 streams x 16K the ``j = 0`` graph took
25.0 ms against real steps of 22.7), and a ``j`` never chosen is never measured. So once
the best ``j`` is measured, a ``j`` still timed only by its graph whose tokens per second
are within ``EXPLORE_MARGIN`` of it is chosen for up to ``EXPLORE_TRIES`` steps (per
``COST_STALE`` choices) until it has a measurement (run 83 chose ``j = 2`` on measured
40.4 ms against the graph's 25.0 for ``j = 0``, and lost 13% to no speculation); one
whose timing is scaled from a neighbouring size only within ``EXPLORE_MARGIN_SCALED``.

**Acceptance** per position is counted from the steps that verified drafts, with counts
decaying by ``DECAY`` an engine step (steps without drafts included) so the estimate
follows the traffic: ``a_m = accepted_m / reached_m``, ``reached_m`` the verify rows that
had a draft ``m`` and accepted drafts ``1 .. m-1``. Until a position has
``MIN_EVIDENCE`` rows, its prior ``PRIOR`` stands in (blended in proportion).

**Measuring first, and probing**: a policy that chose no drafts would never see a verify
row again, so its estimate would freeze (a fresh engine whose prior says "no" would never
speculate, whatever the real acceptance). So until the first position has
``MIN_EVIDENCE`` rows the policy picks ``k`` (it measures before it decides), and after
``PROBE_EVERY`` steps in a row below ``k`` it picks ``k`` for ``PROBE_STEPS`` steps (the
first proposes drafts, the next verifies them): about 1% of the steps at worst.

Pure host arithmetic on small tables: no torch, no device.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Mapping, Sequence

PRIOR = 0.6  # acceptance assumed at a position with no evidence yet
MIN_EVIDENCE = 64.0  # verify rows at a position before the measured rate stands alone
DECAY = 0.995  # per step: about 200 steps of memory
PROBE_EVERY = 256  # steps in a row below k before a probe
PROBE_STEPS = 2  # a probe: one step proposes drafts, the next verifies them
COST_WINDOW = 5  # measured step times kept per (graph, j); their median is the cost
COST_MIN_OBS = 2  # measured times before they replace the graph timing
COST_STALE = 1024  # choices after which a shape's measured times are forgotten
COST_BAND = (0.5, 2.0)  # a measured time outside this many graph timings is not kept
EXPLORE_MARGIN = 0.15  # a graph-timed j this close to the measured best is measured too
EXPLORE_TRIES = COST_MIN_OBS + 2  # steps run to measure it (some land as other shapes)
EXPLORE_MARGIN_SCALED = 0.03  # ... and one timed from a neighbouring size's measurement


class DraftPolicy:
    def __init__(self, k: int, prior: float = PRIOR, decay: float = DECAY) -> None:
        if k < 1:
            raise ValueError(f"a draft policy needs num_speculative_tokens >= 1, got {k}")
        self.k = k
        self.prior = prior
        self.decay = decay
        self.reached = [0.0] * (k + 1)  # index m: rows that verified a draft m, 1..m-1 accepted
        self.accepted = [0.0] * (k + 1)
        self.widths: list[int] = []
        self.sizes: dict[int, list[int]] = {}  # width -> captured sizes with every j timed
        self.costs: dict[tuple[int, int], list[float]] = {}  # (width, size) -> s for j=0..k
        # (width, size, j) -> the last measured step times, and the choice count then
        self.measured: dict[tuple[int, int, int], deque[float]] = {}
        self._measured_at: dict[tuple[int, int, int], int] = {}
        # (width, size, j) -> steps chosen to measure it, and the choice count then
        self._explored: dict[tuple[int, int, int], tuple[int, int]] = {}
        self.last_choice = k
        self.steps = 0  # choices made (engine steps)
        self._observed_at = 0  # self.steps at the last observation
        self._below_k = 0  # steps in a row that chose fewer than k drafts
        self._probe_left = 0  # steps of the running probe still to go

    # -- inputs -------------------------------------------------------------------------
    def set_costs(self, costs: Mapping[tuple[int, int, int], float]) -> None:
        """Seconds a step takes per (padded batch size, drafts j, context width). Shapes
        missing some ``j`` are left out (the policy never picks a shape it has no cost
        for)."""
        self.costs = {}
        for width, size in sorted({(w, s) for s, _, w in costs}):
            row = [costs.get((size, j, width)) for j in range(self.k + 1)]
            if all(c is not None and c > 0 for c in row):
                self.costs[(width, size)] = [float(c) for c in row if c is not None]
        self.widths = sorted({w for w, _ in self.costs})
        self.sizes = {w: sorted(s for w2, s in self.costs if w2 == w) for w in self.widths}

    def observe_cost(self, batch: int, context: int, j: int, seconds: float) -> None:
        """A landed step of ``batch`` requests verifying ``j`` drafts each (proposing
        drafts iff ``j > 0``), longest context ``context``, took ``seconds``."""
        shape = self.shape(batch, context)
        if shape is None or not 0 <= j <= self.k or seconds <= 0:
            return
        lo, hi = COST_BAND
        if not lo <= seconds / self.costs[shape][j] <= hi:
            return  # not this step alone: an idle gap, a stall, a mislabelled step
        key = (*shape, j)
        times = self._fresh(key)
        if times is None:
            times = self.measured[key] = deque(maxlen=COST_WINDOW)
        times.append(seconds)
        self._measured_at[key] = self.steps

    def _fresh(self, key: tuple[int, int, int]) -> deque[float] | None:
        """The step times measured for ``key`` unless older than ``COST_STALE`` choices."""
        times = self.measured.get(key)
        if times is None or self.steps - self._measured_at[key] > COST_STALE:
            return None
        return times

    def step_costs(self, batch: int, context: int) -> list[float] | None:
        """Seconds of a step with ``j = 0..k`` at the graph ``(batch, context)`` runs on:
        measured where the shape has run lately, else the graph timing (scaled as a
        neighbouring size measured it, where one did); None if the policy has no costs
        for it."""
        shape = self.shape(batch, context)
        return None if shape is None else self._costs(shape)[0]

    def _costs(self, shape: tuple[int, int]) -> tuple[list[float], list[str]]:
        """:meth:`step_costs` of a graph shape, and how each was timed: ``"measured"`` at
        this shape, ``"scaled"`` (its graph timing by a neighbouring size's measured
        ratio), ``"graph"``."""
        out = list(self.costs[shape])
        how = ["graph"] * (self.k + 1)
        for j in range(self.k + 1):
            median = self._measured(shape, j)
            if median is not None:
                out[j], how[j] = median, "measured"
                continue
            ratio = self._neighbour_ratio(shape, j)
            if ratio is not None:
                out[j], how[j] = out[j] * ratio, "scaled"
        return out, how

    def _measured(self, shape: tuple[int, int], j: int) -> float | None:
        """The median of ``j``'s fresh step times at ``shape``, once there are enough."""
        times = self._fresh((*shape, j))
        return statistics.median(times) if times is not None and len(times) >= COST_MIN_OBS else None

    def _neighbour_ratio(self, shape: tuple[int, int], j: int) -> float | None:
        """``measured / graph`` of ``j`` at the nearest other size (by ratio of sizes; the
        smaller one on a tie) of ``shape``'s width that has it measured."""
        width, size = shape
        best: tuple[float, int, float] | None = None
        for w, other, jj in self.measured:  # the shapes that ever ran: few, unlike sizes
            if w != width or jj != j or other == size:
                continue
            median = self._measured((width, other), j)
            if median is None:
                continue
            near = (max(other, size) / min(other, size), other)
            if best is None or near < best[:2]:
                best = (*near, median / self.costs[(width, other)][j])
        return None if best is None else best[2]

    def shape(self, batch: int, context: int) -> tuple[int, int] | None:
        """The captured graph ``(width, size)`` a step of ``batch`` requests at longest
        context ``context`` runs on: the narrowest width it fits, the next size up."""
        i = bisect.bisect_left(self.widths, context)
        if i == len(self.widths):
            return None
        width = self.widths[i]
        sizes = self.sizes[width]
        n = bisect.bisect_left(sizes, batch)
        return None if n == len(sizes) else (width, sizes[n])

    def reset_acceptance(self) -> None:
        """Forget the acceptance measured so far (back to the prior)."""
        self.reached = [0.0] * (self.k + 1)
        self.accepted = [0.0] * (self.k + 1)

    def observe(self, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """One step's verify rows: for each, the drafts it verified and how many of them
        were accepted (placeholders never count; a row with 0 drafts is skipped)."""
        d = self.decay ** max(1, self.steps - self._observed_at)  # the steps since the last
        self._observed_at = self.steps
        self.reached = [r * d for r in self.reached]
        self.accepted = [a * d for a in self.accepted]
        for j, a in zip(verified, accepted, strict=True):
            if j <= 0:
                continue
            a = min(a, j)
            for m in range(1, min(a + 1, j) + 1):  # drafts 1..a accepted, a+1 tried
                self.reached[m] += 1.0
                if m <= a:
                    self.accepted[m] += 1.0

    # -- outputs ------------------------------------------------------------------------
    def acceptance(self) -> list[float]:
        """``a_1 .. a_k``: measured rates blended with the prior where evidence is thin."""
        out = []
        for m in range(1, self.k + 1):
            r = self.reached[m]
            w = min(1.0, r / MIN_EVIDENCE)
            rate = self.accepted[m] / r if r > 0 else self.prior
            out.append(w * rate + (1.0 - w) * self.prior)
        return out

    def expected_tokens(self) -> list[float]:
        """``E(0) .. E(k)``: tokens a request gains per step with ``j`` drafts."""
        out, run, total = [1.0], 1.0, 1.0
        for a in self.acceptance():
            run *= a
            total += run
            out.append(total)
        return out

    def choose(self, batch: int, context: int = 0) -> int:
        """Drafts for a step of ``batch`` requests whose longest context is ``context``:
        ``k`` while measuring or probing (module docstring), else the ``j`` with the most
        tokens per second at the graph the step runs on; ``k`` with no costs for it."""
        self.steps += 1
        best, rival = self._best(batch, context)
        if best < self.k:
            if self.reached[1] < MIN_EVIDENCE or self._probe_left > 0:
                best, rival = self.k, None
            elif self._below_k + 1 >= PROBE_EVERY:
                self._probe_left, best, rival = PROBE_STEPS, self.k, None
        if rival is not None:  # a step run to measure it
            self._explored[rival] = (self._tries(rival) + 1, self.steps)
        if best < self.k:
            self._below_k += 1
        else:
            self._below_k = 0
        self._probe_left = max(0, self._probe_left - 1)
        self.last_choice = best
        return best

    def _best(self, batch: int, context: int) -> tuple[int, tuple[int, int, int] | None]:
        """The ``j`` with the most tokens per second at the step's graph (``k``: no costs),
        or a rival timed only by its graph that is worth measuring (module docstring),
        with its ``(width, size, j)`` then."""
        shape = self.shape(batch, context)
        if shape is None:
            return self.k, None
        cost, how = self._costs(shape)
        gain = self.expected_tokens()
        rates = [gain[j] / cost[j] for j in range(self.k + 1)]
        best = max(range(self.k + 1), key=lambda j: (rates[j], -j))  # ties: fewer drafts
        if how[best] != "measured":
            return best, None  # it is measured by running it
        margin = {"graph": EXPLORE_MARGIN, "scaled": EXPLORE_MARGIN_SCALED}
        rivals = [
            j
            for j in range(self.k + 1)
            if how[j] != "measured"
            and rates[j] >= (1.0 - margin[how[j]]) * rates[best]
            and self._tries((*shape, j)) < EXPLORE_TRIES
        ]
        if not rivals:
            return best, None
        j = max(rivals, key=lambda j: (rates[j], -j))
        return j, (*shape, j)

    def _tries(self, key: tuple[int, int, int]) -> int:
        """Steps run to measure ``key`` in the last ``COST_STALE`` choices."""
        n, at = self._explored.get(key, (0, 0))
        return n if self.steps - at <= COST_STALE else 0
