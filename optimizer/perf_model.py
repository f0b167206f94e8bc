"""A fitted model of why a configuration wins or loses (docs/design.md), used to choose the next trial.

Every measured trial yields, per concurrency level b, the accept length AL (tokens per verify
cycle, bonus included: completion_tokens / spec_verify_ct) and the per-request cycle time
(AL / per-user tok/s); its host's baseline yields the plain decode step s_b.  The model:

* acceptance: a conditional acceptance a_i per draft position i (a random walk in logit space, so
  positions never measured follow the deepest one measured), and a tree gain g: a tree of width
  w = min(topk, 1 + (n-1)/d) at depth d = min(steps, n-1) cuts each position's rejection
  probability by (1-g)^log2(w).  AL = 1 + sum_j prod_{i<=j} a_i'.
* cost, relative to one plain decode step at the same batch (host offsets and drift cancel):
  r_b = steps * delta * (1 + gamma (topk-1)) + phi(b n) / phi(b) + omega / phi(b), where
  phi(N) = 1 + beta min(N-1, x) + beta' max(0, N-1-x) is the target forward over N tokens
  (steep up to a knee x on MoE and slow interconnects, linear on dense models).
* speedup at level b = AL / r_b.
* the verify cost's shape, where the hosts' baselines carry a verify probe (optimizer.verify_probe):
  each probed phi(b k) / phi(b) is data for the cost half next to the trials' cycle ratios
  (`fit`'s `shapes`), so beta, the knee and beta' hold this host's forward before the first
  speculative launch reaches those token counts.

These are the relations of docs/calibration.md §6 written as a regression.  Both halves are
fitted by regularised least squares (priors from the published ranges, so two or three trials
already give a usable answer), and a Laplace approximation gives each prediction a standard
deviation for the acquisition function.  The fit is milliseconds for tens of trials.

What that fixed form leaves unexplained is itself modelled (issue 31: engines of other shapes):
a Gaussian process on the residuals of log accept length (by depth, tree width and draft
tokens) and of log cycle ratio (by verified tokens b n, batch, depth and topk: knees, tiles,
expert saturation, draft cost by width), with a per-host offset as a random effect
(optimizer.residual_gp).  Its mean bends each prediction towards what was measured near it; its
variance, sized by the study's own leave-one-out residuals, is the model's misfit in every
prediction's sd, so an engine the form cannot describe widens the intervals instead of leaving
them confidently wrong.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import least_squares

from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.residual_gp import ResidualGP
from optimizer.space import SpecConfig
from optimizer.verify_probe import VerifyShape

FloatArray = NDArray[np.float64]

# The priors (mean, sd, in the units above; ranges from docs/calibration.md sections 4-6), the
# knees tried for the verify cost, the measurement noise of AL and of the cycle ratio, the floor on
# a prediction's sd and the eager penalty are the study's policy (optimizer.policy: accept_first
# ... eager_penalty), handed to `fit` and kept by the model it returns.


@dataclass(frozen=True)
class Observation:
    """One measured level of one trial."""

    num_steps: int
    topk: int
    num_draft_tokens: int
    concurrency: int
    accept_length: float
    cycle_ratio: float  # cycle time / baseline decode step at the same level and host
    eager: bool = False
    host: str | None = None  # the worker that measured it (its offset is a random effect)
    believed: bool = False  # a believed launch (optimizer.believer): fitted, but not by the residual GP


@dataclass(frozen=True)
class Candidates:
    """Configurations to score, as parallel arrays (canonical values)."""

    configs: tuple[SpecConfig, ...]
    steps: FloatArray
    topk: FloatArray
    ndt: FloatArray
    graph_bs: FloatArray  # largest captured batch; +inf when captured for every level

    @classmethod
    def of(cls, configs: Sequence[SpecConfig]) -> Candidates:
        cs = tuple(c.canonical() for c in configs)
        return cls(
            configs=cs,
            steps=np.array([c.num_steps for c in cs], dtype=float),
            topk=np.array([c.topk for c in cs], dtype=float),
            ndt=np.array([c.num_draft_tokens for c in cs], dtype=float),
            graph_bs=np.array([math.inf if c.cuda_graph_max_bs is None else c.cuda_graph_max_bs for c in cs]),
        )


def accept_lengths(steps: FloatArray, topk: FloatArray, ndt: FloatArray, logits: FloatArray, gain: float) -> FloatArray:
    """AL for each configuration (vectorised over configurations)."""
    depth = np.minimum(steps, ndt - 1.0)
    width = np.minimum(topk, 1.0 + (ndt - 1.0) / np.maximum(depth, 1.0))
    keep = np.where(width > 1.0, (1.0 - gain) ** np.log2(np.maximum(width, 1.0)), 1.0)
    positions = int(max(depth.max(initial=1.0), 1.0))
    rates = _expand(logits, positions)
    a = 1.0 - (1.0 - rates[None, :]) * keep[:, None]
    mask = np.arange(positions)[None, :] < depth[:, None]
    cum = np.cumprod(np.where(mask, a, 1.0), axis=1)
    out: FloatArray = 1.0 + np.where(mask, cum, 0.0).sum(axis=1)
    return out


def _expand(logits: FloatArray, positions: int) -> FloatArray:
    """Acceptance per position 1..positions: the last fitted position repeats beyond the fit."""
    if positions <= len(logits):
        u = logits[:positions]
    else:
        u = np.concatenate([logits, np.full(positions - len(logits), logits[-1])])
    out: FloatArray = 1.0 / (1.0 + np.exp(-u))
    return out


def _phi(tokens: FloatArray, beta: float, knee: float, beta_after: float) -> FloatArray:
    extra = np.maximum(tokens - 1.0, 0.0)
    out: FloatArray = 1.0 + beta * np.minimum(extra, knee) + beta_after * np.maximum(extra - knee, 0.0)
    return out


def cycle_ratios(
    steps: FloatArray,
    topk: FloatArray,
    ndt: FloatArray,
    batch: FloatArray,
    cost: FloatArray,
    knee: float,
) -> FloatArray:
    """r_b for each (configuration, level) pair; `cost` = (delta, gamma, beta, beta', omega)."""
    delta, gamma, beta, beta_after, omega = (float(v) for v in cost)
    phi_b = _phi(batch, beta, knee, beta_after)
    out: FloatArray = (
        steps * delta * (1.0 + gamma * (topk - 1.0)) + _phi(batch * ndt, beta, knee, beta_after) / phi_b + omega / phi_b
    )
    return out


@dataclass
class FittedModel:
    logits: FloatArray
    gain: float
    accept_cov: FloatArray
    cost: FloatArray
    knee: float
    cost_cov: FloatArray
    n_observations: int
    extra: dict[str, Any] = field(default_factory=dict)
    # The fixed form's residuals (optimizer.residual_gp): log accept length by configuration, log
    # cycle ratio by (configuration, level).  None: nothing to learn them from.
    al_gp: ResidualGP | None = None
    cost_gp: ResidualGP | None = None
    # The study's policy it was fitted under: its floor and eager penalty shape every prediction.
    policy: Policy = DEFAULT_POLICY

    def _residual(
        self, cand: Candidates, levels: Sequence[int], weights: Sequence[float], ref: Candidates | None, new: bool
    ) -> tuple[FloatArray, FloatArray]:
        """Mean and variance the residual terms add to each candidate's objective (the weighted
        mean over levels of log AL - log r), or to its difference from `ref`'s one configuration."""
        n = len(cand.configs)
        mean, var = np.zeros(n), np.zeros(n)
        w = np.asarray(weights, dtype=float) / float(sum(weights))
        if self.al_gp is not None:
            q = accept_coords(cand)[:, None, :]
            a = np.ones((n, 1))
            if ref is not None:
                q = np.concatenate([q, np.repeat(accept_coords(ref)[:1, None, :], n, axis=0)], axis=1)
                a = np.concatenate([a, -a], axis=1)
            m, v = self.al_gp.moments(q, a, new_launch=new)
            mean, var = mean + m, var + v
        if self.cost_gp is not None:
            q = np.stack([cost_coords(cand, float(b)) for b in levels], axis=1)
            a = np.repeat(w[None, :], n, axis=0)
            if ref is not None:
                qr = np.stack([cost_coords(ref, float(b))[:1] for b in levels], axis=1)
                q = np.concatenate([q, np.repeat(qr, n, axis=0)], axis=1)
                a = np.concatenate([a, -a], axis=1)
            m, v = self.cost_gp.moments(q, a, new_launch=new)
            mean, var = mean - m, var + v
        return mean, var

    def predict_log_speedup(
        self,
        cand: Candidates,
        levels: Sequence[int],
        weights: Sequence[float],
        *,
        with_sd: bool = True,
        new_launch: bool = True,
    ) -> tuple[FloatArray, FloatArray]:
        """Mean and sd of the weighted mean over levels of log(speedup) for every candidate: of a
        measurement of a new launch of it, or with `new_launch` False of its value alone."""
        theta = np.concatenate([self.logits, [self.gain], self.cost])
        mean = self._objective(theta, cand, levels, weights)
        if not with_sd:
            return mean + self._residual(cand, levels, weights, None, True)[0], np.zeros_like(mean)
        cov = self._cov(len(theta))
        grads = self._gradients(theta, cand, levels, weights, mean)
        var = np.einsum("ic,ij,jc->c", grads, cov, grads)
        # A measurement of a new launch: the misfit, an unknown host's offset and launch noise too.
        r_mean, r_var = self._residual(cand, levels, weights, None, new_launch)
        return mean + r_mean, np.sqrt(np.maximum(var, 0.0) + r_var + self.policy.model_floor**2)

    def predict_gain(
        self,
        cand: Candidates,
        ref: Candidates,
        levels: Sequence[int],
        weights: Sequence[float],
        floor: FloatArray | float | None = None,
    ) -> tuple[FloatArray, FloatArray]:
        """Mean and sd of log(speedup of each candidate / speedup of `ref`'s one configuration).

        The difference's sd comes from the difference of the gradients, so what the model is
        unsure of for both alike (a neighbour of the incumbent) cancels, as it should; `floor`
        (per candidate) stands for the model's own misspecification (None: the policy's floor).
        """
        floor = self.policy.model_floor if floor is None else floor
        theta = np.concatenate([self.logits, [self.gain], self.cost])
        both = Candidates.of(list(cand.configs) + list(ref.configs[:1]))
        base = self._objective(theta, both, levels, weights)
        cov = self._cov(len(theta))
        grads = self._gradients(theta, both, levels, weights, base)
        dg = grads[:, :-1] - grads[:, -1:]
        var = np.einsum("ic,ij,jc->c", dg, cov, dg)
        # The residual's difference: what the two configurations share (neighbours) cancels.
        r_mean, r_var = self._residual(cand, levels, weights, Candidates.of(list(ref.configs[:1])), False)
        return base[:-1] - base[-1] + r_mean, np.sqrt(np.maximum(var, 0.0) + r_var + np.asarray(floor) ** 2)

    def _gradients(
        self,
        theta: FloatArray,
        cand: Candidates,
        levels: Sequence[int],
        weights: Sequence[float],
        at: FloatArray,
    ) -> FloatArray:
        """d objective / d theta per candidate (rows: parameters), by forward differences from `at`."""
        grads = np.empty((len(theta), len(at)))
        for j in range(len(theta)):
            h = 1e-4 * max(1.0, abs(theta[j]))
            bumped = theta.copy()
            bumped[j] += h
            grads[j] = (self._objective(bumped, cand, levels, weights) - at) / h
        return grads

    def _cov(self, n: int) -> FloatArray:
        cov = np.zeros((n, n))
        na = len(self.logits) + 1
        cov[:na, :na] = self.accept_cov
        cov[na:, na:] = self.cost_cov
        return cov

    def _objective(
        self, theta: FloatArray, cand: Candidates, levels: Sequence[int], weights: Sequence[float]
    ) -> FloatArray:
        total = np.zeros(len(cand.configs))
        for w, (al, r) in zip(weights, self._per_level(theta, cand, levels), strict=True):
            total += w * (np.log(al) - np.log(r))
        return total / float(sum(weights))

    def _per_level(
        self, theta: FloatArray, cand: Candidates, levels: Sequence[int]
    ) -> list[tuple[FloatArray, FloatArray]]:
        """(accept length, cycle ratio) of every candidate at each level, under parameters `theta`."""
        na = len(self.logits)
        logits, gain, cost = theta[:na], float(np.clip(theta[na], 0.0, 0.95)), np.maximum(theta[na + 1 :], 0.0)
        al = accept_lengths(cand.steps, cand.topk, cand.ndt, logits, gain)
        out = []
        for level in levels:
            b = np.full(len(cand.configs), float(level))
            r = cycle_ratios(cand.steps, cand.topk, cand.ndt, b, cost, self.knee)
            out.append((al, np.where(cand.graph_bs < level, r * self.policy.eager_penalty, r)))
        return out

    def predict_levels(self, config: SpecConfig, levels: Sequence[int]) -> list[tuple[float, float]]:
        """The fitted (accept length, cycle ratio to a plain decode step) of `config` at each level:
        what a launch of it would report if the model were right."""
        theta = np.concatenate([self.logits, [self.gain], self.cost])
        cand = Candidates.of([config])
        al_shift = 0.0
        if self.al_gp is not None:
            m, _ = self.al_gp.moments(accept_coords(cand)[:, None, :], np.ones((1, 1)))
            al_shift = float(m[0])
        out: list[tuple[float, float]] = []
        for (al, r), b in zip(self._per_level(theta, cand, levels), levels, strict=True):
            r_shift = 0.0
            if self.cost_gp is not None:
                m, _ = self.cost_gp.moments(cost_coords(cand, float(b))[:, None, :], np.ones((1, 1)))
                r_shift = float(m[0])
            out.append((float(al[0]) * math.exp(al_shift), float(r[0]) * math.exp(r_shift)))
        return out

    def accept_length(self, config: SpecConfig) -> float:
        c = Candidates.of([config])
        return float(accept_lengths(c.steps, c.topk, c.ndt, self.logits, self.gain)[0])


def fit(
    observations: Sequence[Observation],
    max_steps: int,
    shapes: Mapping[str, VerifyShape] | None = None,
    policy: Policy = DEFAULT_POLICY,
) -> FittedModel | None:
    """Fit both halves; None when there is nothing to fit.

    `shapes`: each host's verify cost shape from its baseline's probe (optimizer.verify_probe,
    `latest_shapes`): data for the cost half next to the trials' cycle ratios (`probe_rows`).
    Without them the fit is the trials' alone.  `policy`: the study's (its priors, noise, knees,
    residual grid and floors; the snapshot's, optimizer.policy)."""
    if not observations:
        return None
    logits, gain, acov, al_gp = _fit_acceptance(observations, max_steps, policy)
    cost, knee, ccov, cost_gp = _fit_cost(observations, probe_rows(shapes, policy.probe_floor), policy)
    return FittedModel(
        logits, gain, acov, cost, knee, ccov, len(observations), al_gp=al_gp, cost_gp=cost_gp, policy=policy
    )


def accept_coords(cand: Candidates) -> FloatArray:
    """Where a configuration's acceptance sits for the residual: depth in twos, log2 tree width,
    log2 draft tokens (optimizer.residual_gp's unit length: a neighbour)."""
    depth = np.minimum(cand.steps, cand.ndt - 1.0)
    width = np.minimum(cand.topk, 1.0 + (cand.ndt - 1.0) / np.maximum(depth, 1.0))
    return np.stack([depth / 2.0, np.log2(np.maximum(width, 1.0)), np.log2(cand.ndt)], axis=1)


def cost_coords(cand: Candidates, batch: float) -> FloatArray:
    """Where a (configuration, level)'s cycle cost sits for the residual: log2 of the tokens one
    verify pass carries (b n: knees, tiles, expert saturation), log2 batch, draft depth in twos,
    log2 topk (draft cost by width)."""
    b = np.full(len(cand.configs), batch)
    return np.stack([np.log2(b * cand.ndt), np.log2(b), cand.steps / 2.0, np.log2(cand.topk)], axis=1)


def _leverage(jac: FloatArray, rows: int) -> FloatArray:
    """Each data row's leverage in a whitened, regularised least-squares fit (its first `rows`
    residuals are the data, the rest the priors): diag of J_d (J'J)^-1 J_d'."""
    j = np.asarray(jac, dtype=float)
    inv = np.linalg.pinv(j.T @ j + 1e-9 * np.eye(j.shape[1]))
    jd = j[:rows]
    return np.asarray(np.einsum("ij,jk,ik->i", jd, inv, jd), dtype=np.float64)


def _residual_gp(x: FloatArray, resid: FloatArray, noise: FloatArray, policy: Policy, **kw: Any) -> ResidualGP | None:
    """The residual's posterior over the policy's hyperparameter grid (optimizer.residual_gp)."""
    return ResidualGP.fit(
        x,
        resid,
        noise,
        amplitudes=policy.residual_amplitudes,
        lengths=policy.residual_lengths,
        host_sds=policy.residual_host_sds,
        extra_noise=policy.residual_extra_noise,
        **kw,
    )


def _fit_acceptance(
    obs: Sequence[Observation], max_steps: int, policy: Policy
) -> tuple[FloatArray, float, FloatArray, ResidualGP | None]:
    # One AL per configuration (mean over its levels and repeats): acceptance does not depend on
    # the batch, and weighting every level would count one measurement several times.
    by_config: dict[tuple[int, int, int], list[float]] = {}
    real: set[tuple[int, int, int]] = set()
    for o in obs:
        by_config.setdefault((o.num_steps, o.topk, o.num_draft_tokens), []).append(o.accept_length)
        if not o.believed:
            real.add((o.num_steps, o.topk, o.num_draft_tokens))
    keys = list(by_config)
    steps = np.array([k[0] for k in keys], dtype=float)
    topk = np.array([k[1] for k in keys], dtype=float)
    ndt = np.array([k[2] for k in keys], dtype=float)
    al = np.array([sum(v) / len(v) for v in by_config.values()])
    sd = policy.al_noise * al / np.sqrt([len(v) for v in by_config.values()])
    depth = int(max(1, min(max_steps, int(np.minimum(steps, ndt - 1).max()))))

    def residuals(p: FloatArray) -> FloatArray:
        u, g = p[:depth], p[depth]
        pred = accept_lengths(steps, topk, ndt, u, g)
        prior = [(u[0] - policy.accept_first[0]) / policy.accept_first[1]]
        prior += list(np.diff(u) / policy.accept_step_sd)
        prior.append((g - policy.tree_gain[0]) / policy.tree_gain[1])
        return np.concatenate([(pred - al) / sd, prior])

    x0 = np.concatenate([np.full(depth, policy.accept_first[0]), [policy.tree_gain[0]]])
    lo = np.concatenate([np.full(depth, -8.0), [0.0]])
    hi = np.concatenate([np.full(depth, 8.0), [0.9]])
    res = least_squares(residuals, x0, bounds=(lo, hi), method="trf")
    logits, gain = res.x[:depth].copy(), float(res.x[depth])
    cand = Candidates(tuple(), steps, topk, ndt, np.full(len(keys), math.inf))
    resid = np.log(al) - np.log(accept_lengths(steps, topk, ndt, logits, gain))
    m = np.array([k in real for k in keys])
    lev = _leverage(res.jac, len(keys))
    gp = _residual_gp(accept_coords(cand)[m], resid[m], (sd / al)[m], policy, leverage=lev[m]) if m.any() else None
    return logits, gain, _laplace(res.jac), gp


@dataclass(frozen=True)
class ProbeRows:
    """Verify probe points as the cost half's data: at batch b, k new tokens per request cost
    `ratio` decode steps (shape(b, k) = phi(b k) / phi(b)), with a relative sd `sd`."""

    batch: FloatArray
    tokens: FloatArray
    ratio: FloatArray
    sd: FloatArray

    def __len__(self) -> int:
        return len(self.batch)


def probe_rows(shapes: Mapping[str, VerifyShape] | None, floor: float = DEFAULT_POLICY.probe_floor) -> ProbeRows:
    """Every host's probe points beyond k = 1 (shape(b, 1) is 1 by construction: no information).
    Each point's relative sd is its own standard error (the probe's repeats, verify_probe.ShapePoint)
    and `floor` in quadrature (the policy's `probe_floor`: an extend is not quite a verify)."""
    rows: list[tuple[float, float, float, float]] = []
    for _, shape in sorted((shapes or {}).items()):
        for b, pts in sorted(shape.points.items()):
            for p in pts:
                if p.tokens > 1 and p.ratio > 0:
                    rows.append((float(b), float(p.tokens), p.ratio, math.hypot(p.sd / p.ratio, floor)))
    a = np.array(rows, dtype=float).reshape(-1, 4)
    return ProbeRows(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), a[:, 3].copy())


def _fit_cost(
    obs: Sequence[Observation], probes: ProbeRows | None = None, policy: Policy = DEFAULT_POLICY
) -> tuple[FloatArray, float, FloatArray, ResidualGP | None]:
    probes = probes if probes is not None else probe_rows(None)
    usable = [o for o in obs if not o.eager]
    if not usable:
        usable = list(obs)
    steps = np.array([o.num_steps for o in usable], dtype=float)
    topk = np.array([o.topk for o in usable], dtype=float)
    ndt = np.array([o.num_draft_tokens for o in usable], dtype=float)
    batch = np.array([o.concurrency for o in usable], dtype=float)
    ratio = np.array([o.cycle_ratio for o in usable])
    priors = (policy.delta, policy.gamma, policy.beta, policy.beta_after, policy.omega)
    mu = np.array([p[0] for p in priors])
    psd = np.array([p[1] for p in priors])
    best: tuple[float, FloatArray, float, FloatArray, FloatArray] | None = None
    for knee in policy.knees:

        def residuals(p: FloatArray, knee: float = float(knee)) -> FloatArray:
            pred = cycle_ratios(steps, topk, ndt, batch, p, knee)
            out = [(np.log(pred) - np.log(ratio)) / policy.cost_noise]
            if len(probes):
                # The probe's shape: phi(b k) / phi(b) against what the baseline server measured.
                beta, beta_after = float(p[2]), float(p[3])
                shape = _phi(probes.batch * probes.tokens, beta, knee, beta_after) / _phi(
                    probes.batch, beta, knee, beta_after
                )
                out.append((np.log(shape) - np.log(probes.ratio)) / probes.sd)
            return np.concatenate([*out, (p - mu) / psd])

        res = least_squares(residuals, mu.copy(), bounds=(np.zeros(5), np.full(5, 5.0)), method="trf")
        if best is None or res.cost < best[0]:
            best = (float(res.cost), res.x.copy(), float(knee), _laplace(res.jac), _leverage(res.jac, len(usable)))
    assert best is not None
    _, cost, knee_at, cov, lev = best
    resid = np.log(ratio) - np.log(cycle_ratios(steps, topk, ndt, batch, cost, knee_at))
    x = np.stack([np.log2(batch * ndt), np.log2(batch), steps / 2.0, np.log2(topk)], axis=1)
    noise = np.full(len(usable), policy.cost_noise)
    m = np.array([not o.believed for o in usable])
    hosts = [o.host for o, keep in zip(usable, m, strict=True) if keep]
    gp = _residual_gp(x[m], resid[m], noise[m], policy, leverage=lev[m], hosts=hosts) if m.any() else None
    return cost, knee_at, cov, gp


def _laplace(jac: FloatArray) -> FloatArray:
    """Covariance of the parameters at the optimum of a whitened least-squares problem."""
    h = jac.T @ jac
    return np.asarray(np.linalg.pinv(h + 1e-9 * np.eye(len(h))), dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# From stored trial attributes to observations


def observations_from_attrs(
    config: Mapping[str, Any],
    levels: Iterable[Mapping[str, Any]],
    baseline_levels: Iterable[Mapping[str, Any]],
    host: str | None = None,
) -> list[Observation]:
    """Observations of one trial from what the service stores with it (see api.services.leasing).

    A level needs the accept length and a per-user rate for the trial and the baseline; levels
    without them (an engine that reports no accept length) are skipped.
    """
    cfg = SpecConfig.model_validate(dict(config)).canonical()
    base = {int(b["concurrency"]): b for b in baseline_levels}
    out = []
    for lv in levels:
        c = int(lv["concurrency"])
        al = lv.get("accept_length")
        b = base.get(c)
        if al is None or al < 1.0 or b is None:
            continue
        user = per_user_rate(lv, c)
        base_user = per_user_rate(b, c)
        if user is None or base_user is None:
            continue
        cycle = al / user
        step = 1.0 / base_user
        eager = cfg.cuda_graph_max_bs is not None and cfg.cuda_graph_max_bs < c
        out.append(
            Observation(
                cfg.num_steps, cfg.topk, cfg.num_draft_tokens, c, float(al), float(cycle / step), eager=eager, host=host
            )
        )
    return out


def per_user_rate(level: Mapping[str, Any], concurrency: int) -> float | None:
    """A level's tokens/s per request: as reported, else the level's total over its concurrency."""
    v = level.get("per_user_tok_s")
    if v is None or v <= 0:
        total = level.get("output_tok_s")
        if total is None or total <= 0:
            return None
        return float(total) / concurrency
    return float(v)
