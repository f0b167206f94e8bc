"""What the performance model's fixed form leaves unexplained, as a Gaussian process (issue 31).

`optimizer.perf_model` writes accept length and cycle time in one physical form each (a
conditional acceptance per draft position, a verify cost with one knee).  Engines of other shapes
(verify cost in tiles, MoE expert saturation, tree gain by rank, draft cost growing with width)
leave residuals that form cannot absorb.  This module models those residuals (in log units) as a
Gaussian process over where a configuration sits, so that

* the prediction bends towards what was measured near a candidate (the posterior mean), and
* the predictive sd holds the model's own misfit: far from what was measured the residual's
  variance returns to the size the study's residuals show (its amplitude), not to zero.

The residual's size is not fixed: it is averaged over a grid of amplitudes, lengths, host offsets
and launch noise, each setting weighted by its prior and by the marginal likelihood of the
residuals (Bayesian model averaging; a handful of Cholesky factorisations of a matrix as large as
the study's observations).  The fixed form's in-sample residuals understate what it misses on a
configuration it did not see, since it was fitted to them; the weights are therefore judged on
leave-one-out residuals (each residual divided by one minus its leverage in the fit, the
standard linear-smoother identity), and the mean on the residuals themselves.

Per-host offsets that a host's own baseline does not cancel are a random effect (a shared term
per host, its sd on the grid): the prediction for a launch on a host not yet known adds its
variance, and the correction's mean carries none of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from optimizer.policy import DEFAULT_POLICY

FloatArray = NDArray[np.float64]

# The hyperparameter grid (the residual's size, its lengths, the per-host offset sd and the extra
# launch noise, each with equal prior weight) is the study's policy (optimizer.policy:
# residual_amplitudes, residual_lengths, residual_host_sds, residual_extra_noise, with their
# sources); optimizer.perf_model hands it over, and these defaults are the default policy's.
# Leverage cap for the leave-one-out residuals (a point the fit passes through exactly would
# divide by zero): at most a tenfold inflation.
MAX_LEVERAGE = 0.9
# Settings kept after weighing (the rest carry little of the posterior): a bound on the work per
# prediction.
KEEP_SETTINGS = 8
_JITTER = 1e-10


def _matern32(a: FloatArray, b: FloatArray, amp: float, length: float) -> FloatArray:
    """Matern 3/2 covariance: rough enough for knees and tiles, smoother than a step."""
    d = np.sqrt(np.maximum(((a[:, None, :] - b[None, :, :]) ** 2).sum(axis=2), 0.0)) * (math.sqrt(3.0) / length)
    out: FloatArray = amp**2 * (1.0 + d) * np.exp(-d)
    return out


@dataclass(frozen=True)
class _Setting:
    amp: float
    length: float
    host_sd: float
    extra_noise: float
    weight: float
    chol: FloatArray  # lower Cholesky factor of the residuals' covariance
    alpha: FloatArray  # covariance^-1 residuals


@dataclass(frozen=True)
class ResidualGP:
    """A posterior over the residual function, averaged over the hyperparameter grid."""

    x: FloatArray  # (n, d) coordinates of the observations
    settings: tuple[_Setting, ...]

    @classmethod
    def fit(
        cls,
        x: FloatArray,
        resid: FloatArray,
        noise_sd: FloatArray,
        *,
        leverage: FloatArray | None = None,
        hosts: Sequence[str | None] | None = None,
        amplitudes: Sequence[float] = DEFAULT_POLICY.residual_amplitudes,
        lengths: Sequence[float] = DEFAULT_POLICY.residual_lengths,
        host_sds: Sequence[float] = DEFAULT_POLICY.residual_host_sds,
        extra_noise: Sequence[float] = DEFAULT_POLICY.residual_extra_noise,
    ) -> ResidualGP | None:
        """The posterior given residuals `resid` (log units) at `x`; None without any."""
        x = np.asarray(x, dtype=float)
        y = np.asarray(resid, dtype=float)
        n = len(y)
        if n == 0:
            return None
        lev = np.zeros(n) if leverage is None else np.clip(np.asarray(leverage, dtype=float), 0.0, MAX_LEVERAGE)
        y_loo = y / (1.0 - lev)
        same_host = np.zeros((n, n))
        if hosts is not None:
            hs = list(hosts)
            same_host = np.array([[float(a is not None and a == b) for b in hs] for a in hs])
        if hosts is None or not same_host.any():
            host_sds = (0.0,)
        base_noise = np.asarray(noise_sd, dtype=float) ** 2
        raw: list[tuple[float, float, float, float, float, FloatArray, FloatArray]] = []
        for length in lengths:
            unit = _matern32(x, x, 1.0, length)
            for amp in amplitudes:
                for hsd in host_sds:
                    for extra in extra_noise:
                        k = amp**2 * unit + hsd**2 * same_host + np.diag(base_noise + extra**2 + _JITTER)
                        try:
                            chol = np.linalg.cholesky(k)
                        except np.linalg.LinAlgError:
                            continue
                        z = np.linalg.solve(chol, y_loo)
                        loglik = -0.5 * float(z @ z) - float(np.log(np.diag(chol)).sum())
                        alpha = np.asarray(np.linalg.solve(chol.T, np.linalg.solve(chol, y)), dtype=np.float64)
                        raw.append((loglik, amp, length, hsd, extra, np.asarray(chol, dtype=np.float64), alpha))
        if not raw:
            return None
        top = max(r[0] for r in raw)
        w = np.array([math.exp(r[0] - top) for r in raw])
        # The settings that carry the posterior (every ask scores hundreds of candidates under each).
        keep = np.argsort(-w)[:KEEP_SETTINGS]
        keep = keep[w[keep] > 1e-4 * w[keep[0]]]
        wk = w[keep] / w[keep].sum()
        settings = tuple(
            _Setting(raw[i][1], raw[i][2], raw[i][3], raw[i][4], float(wi), raw[i][5], raw[i][6])
            for i, wi in zip(keep, wk, strict=True)
        )
        return cls(x, settings)

    def moments(self, q: FloatArray, a: FloatArray, *, new_launch: bool = False) -> tuple[FloatArray, FloatArray]:
        """Mean and variance of sum_p a[i, p] f(q[i, p]) for each i (q: (N, P, d), a: (N, P)).

        `new_launch`: the variance of a measurement of it on a host not yet known (the host
        offset and the launch noise added), not only of the residual function itself.
        """
        q = np.asarray(q, dtype=float)
        a = np.asarray(a, dtype=float)
        n_c, n_p, d = q.shape
        flat = q.reshape(n_c * n_p, d)
        total = a.sum(axis=1)
        mix_mean = np.zeros(n_c)
        mix_sq = np.zeros(n_c)
        for s in self.settings:
            kq = _matern32(flat, self.x, s.amp, s.length)  # (N*P, n)
            mean = (kq @ s.alpha).reshape(n_c, n_p)
            m = (a * mean).sum(axis=1)
            v_solve = np.linalg.solve(s.chol, kq.T)  # (n, N*P)
            u = (v_solve.reshape(-1, n_c, n_p) * a[None, :, :]).sum(axis=2)  # (n, N)
            prior = np.zeros(n_c)
            for p in range(n_p):
                for r in range(n_p):
                    dist = np.sqrt(((q[:, p, :] - q[:, r, :]) ** 2).sum(axis=1)) * (math.sqrt(3.0) / s.length)
                    prior += a[:, p] * a[:, r] * s.amp**2 * (1.0 + dist) * np.exp(-dist)
            var = np.maximum(prior - (u**2).sum(axis=0), 0.0)
            if new_launch:
                var = var + total**2 * (s.host_sd**2 + s.extra_noise**2)
            mix_mean += s.weight * m
            mix_sq += s.weight * (var + m**2)
        return mix_mean, np.maximum(mix_sq - mix_mean**2, 0.0)

    def expected(self, attr: str) -> float:
        """The posterior mean of one hyperparameter ("amp", "host_sd", ...): what the study shows."""
        return float(sum(s.weight * getattr(s, attr) for s in self.settings))
