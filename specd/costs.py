"""What a round of speculation costs: the cost curve of a draft/target pair.

    round_time(k) = k * t_draft + t_target(k + 1) + overhead

t_draft: seconds per drafted token. t_target(n): seconds of one target forward over n new
tokens on a cached prefix (a round with k drafts feeds the pending committed token and the k
drafts). overhead: seconds per round spent outside both (the network round trip between the
draft and target services; 0 in process).

The curve is measured once (`measure_cost_curve`: a few seconds on a CPU, well under one on a
GPU) and kept current while serving (`observe_*`): t_draft is a moving average of observed
draft steps, and the target's measured *shape* t_target(n) is kept while one scale factor
follows the observed forwards (a longer context or a busy machine makes every window slower,
not one window size). Both are moving averages, and every timing estimate specd keeps, with its
rule, is a row of specd.cost_model.TABLE. So a policy that reads the curve adapts by itself to
the hardware it runs on: on a CPU t_target(n) grows steeply with n, on a GPU it is nearly flat.

Under load (the target service verifying many sessions in one forward) a window does not pay
for a forward of its own: it joins one that the other sessions' steps pay for. The target
measures its batched cost surface at start-up, T(B sessions, N tokens) ~ batch_seconds[B] +
(N - B) * batch_token_seconds[B], and reports with each verification how many other sessions
and tokens shared the forward (`observe_load`). A window of k drafts then takes

    loaded_time(k) = k * t_draft + T(1 + B_o, N_o + k + 1) + overhead

and yields its expected tokens plus the other sessions' plain steps (B_o tokens), so the rate a
policy weighs is (E_k + B_o) / loaded_time(k): drafting pays only while the drafted tokens buy
more than they slow everyone's forward. With no one else in the batch it is E_k / round_time(k).

The start-up surface times one session's window beside plain steps; a forward of many short
windows costs more per token than that (on a CPU, each row of every window is a row of every
product). Where the target drafts itself it sees every forward it runs, and `LoadFit` follows
what they really cost: T ~ a * batch_seconds[B] + b * (N - B) * batch_token_seconds[B], (a, b)
fitted online (docs/engine.md, "Drafting on the target").
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specd.cost_model import ESTIMATES, LOAD_FIT_FORGET, LOAD_FIT_PRIOR, LOAD_SMOOTHING, SMOOTHING, decayed
from specd.runtime.kernels import kernels_of
from specd.types import SamplingParams

@dataclass
class CostCurve:
    """Measured costs in seconds: t_draft per drafted token, t_target_k[i] for a ks[i]-token forward."""

    t_draft: float
    ks: list[int]
    t_target_k: list[float]
    overhead: float = 0.0
    smoothing: float = SMOOTHING  # of t_draft and scale (specd.cost_model: curve.*); 0 freezes the curve
    scale: float = 1.0  # observed / measured target cost, followed while serving
    batch_seconds: list[float] = field(default_factory=list)  # [B-1]: a forward of B sessions x 1 token
    batch_token_seconds: list[float] = field(default_factory=list)  # [B-1]: each further token in it
    others: tuple[float, float] = (0.0, 0.0)  # other sessions and their tokens in the target's forwards
    others_yield: float | None = None  # the tokens those sessions emit per forward (None: one each)
    load_smoothing: float = LOAD_SMOOTHING  # weight of one verification's load in `others`
    fit: LoadFit | None = None  # what the target's forwards really cost against the surface, where known
    _fit: tuple[float, float] | None = field(default=None, init=False, repr=False)
    _monotone: list[float] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.ks or len(self.ks) != len(self.t_target_k):
            raise ValueError("a cost curve needs one target time per window size")
        # Plain lists: a policy prices windows several times per drafted token (cost-aware's
        # look-ahead), and numpy's per-call overhead on a scalar dwarfed the arithmetic.
        self._ks = [float(k) for k in self.ks]
        self._ts = [float(t) for t in self.t_target_k]
        self._surface: tuple[float, float, float] | None = None  # (sessions, base, per_token) last asked
        self._reference: tuple | None = None  # (the load it was chosen at, whether the plain steps' forward prices)
        # The unscaled curve at each window size asked: a policy asks the same few sizes many
        # times a round, and only `scale` moves while serving.
        self._at: dict[float, float] = {}

    def t_target(self, k: float) -> float:
        """Interpolate inside the measured ks; extrapolate with a least-squares line beyond."""
        t = self._at.get(k)
        if t is None:
            t = self._unscaled(k)
            if len(self._at) < 1024:
                self._at[k] = t
        return self.scale * t

    def _unscaled(self, k: float) -> float:
        ks, ts = self._ks, self._ts
        if ks[0] <= k <= ks[-1]:
            return interp(k, ks, ts)
        if self._fit is None:
            self._fit = tuple(np.polyfit(ks, ts, 1)) if len(ks) > 1 else (0.0, float(ts[0]))
        slope, intercept = self._fit
        return float(max(intercept + slope * k, 0.0))

    def t_monotone(self, k: float) -> float:
        """t_target on the monotone (isotonic) fit of the measured curve: a forward over more
        tokens never costs less, so a few noisy medians must not make a bigger window look
        cheaper than a smaller one. Extrapolated past the measured ks with the fitted slope."""
        if self._monotone is None:
            self._monotone = isotonic(self._ts).tolist()
        ks, ts = self._ks, self._monotone
        if k <= ks[-1]:
            return self.scale * interp(k, ks, ts)
        if self._fit is None:
            self._fit = tuple(np.polyfit(ks, self._ts, 1)) if len(ks) > 1 else (0.0, float(ts[0]))
        return self.scale * (float(ts[-1]) + (k - ks[-1]) * max(self._fit[0], 0.0))

    def round_time(self, draft_len: int) -> float:
        return draft_len * self.t_draft + self.t_target(draft_len + 1) + self.overhead

    # -- under load ----------------------------------------------------------------------------
    def loaded(self) -> bool:
        return self.others[0] > 0 and bool(self.batch_seconds)

    def loaded_time(self, draft_len: int, plain_others: bool = False) -> float:
        """round_time(draft_len) in a forward shared with the others (round_time when alone);
        plain_others: as if each of them fed one token (a plain step)."""
        if not self.loaded():
            return self.round_time(draft_len)
        sessions, tokens = self.others
        if self._surface is None or self._surface[0] != sessions:  # `others` moves once a round
            self._surface = (sessions, *surface_at(self.batch_seconds, self.batch_token_seconds, 1.0 + sessions))
        _, base, per_token = self._surface
        extra = (0.0 if plain_others else max(tokens - sessions, 0.0)) + draft_len  # tokens beyond one per session
        a, b = (self.fit.a, self.fit.b) if self.fit is not None else (1.0, 1.0)
        return draft_len * self.t_draft + self.scale * (a * base + b * extra * per_token) + self.overhead

    def loaded_rate(self, expected: float, draft_len: int, spent: float = 0.0) -> float:
        """Tokens per second of a round whose window of draft_len drafts yields `expected`
        tokens (and that spent `spent` more seconds), counting what the other sessions in the same
        forward emit: one token each where that is all that is known (their plain steps), else
        what they were seen to emit (their accepted drafts too: a slower forward delays those as
        well).

        The forward is priced as it is, or as it would be with every other session taking a plain
        step, whichever of the two emits more per second without this round's drafts: a drafted
        token must earn at least what the forward's time earns when nobody drafts. Priced only
        as it is, the others' drafts that did not pay slow the forward and so lower the bar for
        this session's, and every session's windows then grow together (docs/engine.md, "The
        plain forward as the reference")."""
        if not self.loaded():  # a policy asks several times per drafted token: the short way
            return expected / (self.round_time(draft_len) + spent)
        sessions = self.others[0]
        others = sessions if self.others_yield is None else self.others_yield
        plain = self._plain_reference(sessions, others)
        if plain:
            return (expected + sessions) / (self.loaded_time(draft_len, plain_others=True) + spent)
        return (expected + others) / (self.loaded_time(draft_len) + spent)

    def _plain_reference(self, sessions: float, others: float) -> bool:
        """Whether the forward with the others' plain steps emits more per second than it does now."""
        key = (self.others, others, self.scale, self.fit.forwards if self.fit is not None else -1)
        if self._reference is None or self._reference[0] != key:
            now = (1.0 + others) / self.loaded_time(0)
            self._reference = (key, (1.0 + sessions) / self.loaded_time(0, plain_others=True) > now)
        return self._reference[1]

    def observe_load(self, other_sessions: int, other_tokens: int, other_yield: int | None = None) -> None:
        """The forward that verified the last window carried this many other sessions and tokens
        (and they emitted other_yield tokens, where known)."""
        a, rule = self.load_smoothing, ESTIMATES["curve.others"]
        s, t = self.others
        self.others = (rule.moved(s, other_sessions, weight=a), rule.moved(t, other_tokens, weight=a))
        if other_yield is not None:
            y = other_sessions if self.others_yield is None else self.others_yield
            self.others_yield = ESTIMATES["curve.others_yield"].moved(y, other_yield, weight=a)

    # -- refreshed while serving ------------------------------------------------------------
    def observe_target(self, n_tokens: int, seconds: float) -> None:
        """One target forward over n_tokens took `seconds`: follow the scale of the curve."""
        base = self.t_target(n_tokens) / self.scale
        if base > 0 and seconds > 0:
            self.scale = ESTIMATES["curve.scale"].moved(self.scale, seconds / base, weight=self.smoothing)

    def observe_draft(self, seconds_per_token: float) -> None:
        self.t_draft = ESTIMATES["curve.t_draft"].moved(self.t_draft, seconds_per_token, weight=self.smoothing)

    def to_dict(self) -> dict:
        out = {"t_draft_s": self.t_draft, "k": list(self.ks),
               "t_target_s": [self.scale * t for t in self.t_target_k], "overhead_s": self.overhead}
        if self.batch_seconds:
            out["batch_s"] = [self.scale * t for t in self.batch_seconds]
            out["batch_token_s"] = [self.scale * t for t in self.batch_token_seconds]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> CostCurve:
        return cls(float(d["t_draft_s"]), [int(k) for k in d["k"]], [float(t) for t in d["t_target_s"]],
                   float(d.get("overhead_s", 0.0)), batch_seconds=[float(t) for t in d.get("batch_s", [])],
                   batch_token_seconds=[float(t) for t in d.get("batch_token_s", [])])


def surface_at(batch_seconds: Sequence[float], batch_token_seconds: Sequence[float],
               sessions: float) -> tuple[float, float]:
    """A forward of `sessions` sessions on a batched cost surface: (its seconds at one token
    each, the seconds of each further token), interpolated between the measured sessions and
    extrapolated past them (each further session costs like the last measured step)."""
    base = interp(sessions, range(1, len(batch_seconds) + 1), batch_seconds)
    per_token = interp(sessions, range(1, len(batch_token_seconds) + 1), batch_token_seconds)
    if sessions > len(batch_seconds):
        steps = batch_seconds
        base = steps[-1] + (sessions - len(steps)) * (steps[-1] - steps[-2] if len(steps) > 1 else steps[-1])
    return base, per_token


@dataclass
class LoadFit:
    """What a target's batched forwards cost, against its start-up surface: a forward of B
    sessions and N new tokens takes a * base(B) + b * (N - B) * per_token(B) seconds
    (surface_at). (a, b) is the least-squares fit of the forwards observed, on relative errors,
    each older forward weighing `forget` times less, and pulled towards (1, 1) by a ridge of
    `prior` (squared shares of a forward: a few forwards' worth, so the fit starts at the surface
    and b stays there while no forward has had further tokens); both stay within [0.2, 10].

    b never falls below a: against the surface, a further token costs at least what the
    forward's base does. The further tokens are a small share of most forwards, so b is the
    fit's least certain term; read below a it priced drafts as nearly free, and every session
    drafted its unlikely tokens into a forward that then slowed everyone (docs/benchmarks.md,
    "Serving many users through the services")."""

    batch_seconds: list[float]
    batch_token_seconds: list[float]
    forget: float = LOAD_FIT_FORGET
    prior: float = LOAD_FIT_PRIOR
    a: float = 1.0
    b: float = 1.0
    forwards: int = 0
    _sums: np.ndarray = field(default_factory=lambda: np.zeros(5), repr=False)  # uu, uv, vv, uz, vz

    def observe(self, sessions: int, tokens: int, seconds: float) -> None:
        """One forward of `sessions` sessions over `tokens` new tokens took `seconds`."""
        if not self.batch_seconds or sessions < 1 or seconds <= 0:
            return
        base, per_token = surface_at(self.batch_seconds, self.batch_token_seconds, sessions)
        x1, x2 = base, per_token * max(tokens - sessions, 0)
        p = x1 + x2
        if p <= 0:
            return
        u, v, z = x1 / p, x2 / p, seconds / p
        self._sums = decayed(self._sums, np.array([u * u, u * v, v * v, u * z, v * z]), self.forget)
        uu, uv, vv, uz, vz = self._sums
        lam = self.prior
        det = (uu + lam) * (vv + lam) - uv * uv
        self.a = min(max(((uz + lam) * (vv + lam) - uv * (vz + lam)) / det, 0.2), 10.0)
        self.b = min(max(((vz + lam) * (uu + lam) - uv * (uz + lam)) / det, self.a), 10.0)
        self.forwards += 1


def median_time(fn: Callable[[], None], repeats: int) -> float:
    """Median seconds of `repeats` calls of fn."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def settle(logits: torch.Tensor) -> None:
    """Wait until a forward's result exists (logits [n, V]): a GPU forward returns before it has
    run, so a timer stopped at its return would time only the queueing of its kernels."""
    logits[-1, :1].tolist()


def measure_t_draft(drafter, prefix: Sequence[int], repeats: int = 7) -> float:
    """Median of single draft steps after a cached prefix (rolled back after each step)."""
    seq, params = list(prefix), SamplingParams()
    session = drafter.open()
    try:
        if drafter.needs_target_features:  # the cost depends on shapes: zero features stand in
            session.observe_target(0, torch.zeros(len(seq) - 1, drafter.hidden_size))
        session.next(seq[:-1], params, None, False)  # prefill all but the last token

        def step():
            session.next(seq, params, None, False)
            session.rollback(len(seq) - 1)

        step()  # warm-up
        return median_time(step, repeats)
    finally:
        session.close()


def interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """np.interp(x, xs, ys) for one x, with the same arithmetic (so the same float), at a
    fraction of numpy's per-call cost: linear between the points of increasing xs, ys[0] before
    the first and ys[-1] after the last."""
    if x >= xs[-1]:
        return float(ys[-1])
    if x < xs[0]:
        return float(ys[0])
    j = bisect_right(xs, x) - 1
    slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j])
    return float(slope * (x - xs[j]) + ys[j])


def isotonic(values: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in np.asarray(values, float):
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return np.concatenate([np.full(int(c), m) for m, c in blocks]) if blocks else np.zeros(0)


def measure_t_target(target, prefix: Sequence[int], ks: Sequence[int] = tuple(range(1, 17)),
                     repeats: int = 5) -> tuple[list[int], list[float], float]:
    """(ks, median t_target(k) for k-token forwards on the cached prefix, prefill time)."""
    prefix = list(prefix)
    kv = target.session()
    try:
        t0 = time.perf_counter()
        kv.extend(prefix, 1)
        t_prefill = time.perf_counter() - t0
        ts = []
        for k in ks:
            ids = (prefix * (k // len(prefix) + 1))[-k:]  # any k tokens: cost depends on k, not ids

            def forward(ids=ids, k=k):
                logits, _ = kv.extend(ids, k)
                settle(logits)
                kv.rollback(len(prefix))

            forward()  # warm-up
            ts.append(median_time(forward, repeats))
    finally:
        kv.close()
    return list(ks), ts, t_prefill


def synthetic_prefix(vocab_size: int, length: int = 64) -> list[int]:
    """The context the start-up measurements run after: any ids do, cost depends on the shape."""
    return [(17 * i + 11) % vocab_size for i in range(length)]


def measure_cost_curve(target, drafter, max_window: int = 16, repeats: int = 3) -> CostCurve:
    """The start-up measurement: forwards of 1..max_window + 1 tokens after a 64-token context,
    and single draft steps after the same context."""
    prefix = synthetic_prefix(target.vocab_size)
    ks, ts, _ = measure_t_target(target, prefix, range(1, max_window + 2), repeats)
    return CostCurve(measure_t_draft(drafter, prefix, repeats), ks, ts)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16",
             "amx_int8", "amx_tile", "asimd", "sve")  # the instruction sets CPU forwards' speed depends on


def cpu_flags() -> list[str]:
    """The instruction-set flags of this CPU that ISA_FLAGS names (from /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ISA_FLAGS if f in have]
    except OSError:
        pass
    return []


def provenance() -> dict:
    """What every benchmark's results file records: the commit, the machine (CPU model, its
    instruction sets, cores; GPUs), the thread count and the versions of torch and
    transformers."""
    import subprocess

    import torch
    import transformers

    try:
        root = Path(__file__).resolve().parents[1]
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, False
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    return {"commit": commit, "dirty": dirty, "cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(),
            "gpus": gpus, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def forwards_of(target) -> str:
    """How the target's pooled forwards run: eager, or which compiled library or CUDA graphs."""
    runner = getattr(getattr(target, "pool", None), "runner", None)
    return "eager" if runner is None else getattr(runner, "key", type(runner).__name__)


def curve_key(target, drafter) -> str:
    """What a measured curve is valid for: the pair, where and how it runs, and on what."""
    dtype = next(target.model.parameters()).dtype
    ident = [target.name, drafter.name, str(target.device), str(dtype), torch.get_num_threads(), cpu_model(),
             torch.__version__, kernels_of(target.model), target.forward_kind(), forwards_of(target)]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


def cached_cost_curve(target, drafter, cache_dir: Path) -> CostCurve:
    """measure_cost_curve, kept under cache_dir/costs/ per pair, device, dtype, threads, CPU and
    torch version, so a one-shot command pays the start-up measurement once per machine (the
    level is refreshed while serving anyway; the shape is what the measurement is for)."""
    path = Path(cache_dir) / "costs" / f"{curve_key(target, drafter)}.json"
    try:
        return CostCurve.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    curve = measure_cost_curve(target, drafter)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(curve.to_dict()))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the whole new one
    except OSError:
        pass  # a read-only cache: measure again next time
    return curve
