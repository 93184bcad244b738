"""Confidence head: predict which drafted tokens the target accepts, and trim proposals to those worth verifying.

``ConfidenceHead`` is a logistic regression over a drafted token's ``TokenFeatures`` plus fixed derived
features (``design_matrix``), standardised with stored means/stds. ``accept_prob`` is the predicted
probability that the target accepts the token *given that every earlier token of the proposal was accepted*
(it is trained on exactly those tokens), so the probability that tokens ``0..i`` are all accepted is the
product of the per-token probabilities. ``FixedK`` is the fallback with the same ``trim``.

Invariants:
- ``trim(p, t)`` returns a prefix of ``p`` (tokens and features together); its length is the largest ``n``
  with ``prod(accept_prob(p.features[:n])) >= t`` (the product is non-increasing in ``n``; ``n = 0`` always
  qualifies, so an empty result is allowed). ``t <= 0`` keeps everything; ``t > 1`` keeps nothing.
- Everything is deterministic: ``fit`` is Newton's method (IRLS) from zero weights with L2 on the weights
  (not the bias), a fixed number of iterations at most.
- A head file is JSON (``save``/``load``); its feature names must equal ``DERIVED_NAMES`` or ``load`` raises
  ``ValueError`` (a head trained on other features would silently mispredict).
- ``load_head(None | "" | missing file)`` gives ``FixedK`` and logs a warning; a present but malformed file
  raises ``ValueError`` (a misconfiguration, not a missing optional file).
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from shared.spec.types import FEATURE_NAMES, Proposal, TokenFeatures

logger = logging.getLogger(__name__)

HEAD_VERSION = 1
DEFAULT_THRESHOLD = 0.3
DEFAULT_K = 5
HEADS_DIR = Path(__file__).parent / "heads"
DERIVED_NAMES = FEATURE_NAMES + ("log_top1_prob", "log1p_ngram_len", "is_first", "log1p_ngram_x_position")
_MIN_STD = 1e-9  # a constant column is standardised with std 1 (it becomes 0 and its weight stays 0)


def design_matrix(raw: np.ndarray) -> np.ndarray:
    """[N, 4] raw rows (``TokenFeatures.as_list()`` order) -> [N, len(DERIVED_NAMES)] float64 features."""
    raw = np.asarray(raw, dtype=np.float64).reshape(-1, len(FEATURE_NAMES))
    top1, ngram, pos = raw[:, 0], np.maximum(raw[:, 2], 0.0), raw[:, 3]
    log_top1 = np.log(np.clip(top1, 1e-6, 1.0))
    log_ngram = np.log1p(ngram)
    is_first = (pos == 0).astype(np.float64)
    return np.column_stack([raw, log_top1, log_ngram, is_first, log_ngram * pos])


def derived_row(f: TokenFeatures) -> list[float]:
    """``design_matrix`` for one token in plain Python (the per-step path: no array overhead)."""
    log_ngram = math.log1p(max(float(f.ngram_len), 0.0))
    return [f.top1_prob, f.entropy, float(f.ngram_len), float(f.position),
            math.log(min(max(f.top1_prob, 1e-6), 1.0)), log_ngram, 1.0 if f.position == 0 else 0.0,
            log_ngram * f.position]


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # exact logistic, no overflow warnings


class Trimmer(Protocol):
    def trim(self, proposal: Proposal, threshold: float | None = None) -> Proposal: ...


class FixedK:
    """Keep the first ``k`` drafted tokens (the behaviour without a confidence head); ignores the threshold."""

    def __init__(self, k: int = DEFAULT_K) -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k

    def trim(self, proposal: Proposal, threshold: float | None = None) -> Proposal:
        return proposal if len(proposal.tokens) <= self.k else proposal.trimmed(self.k)

    def __repr__(self) -> str:
        return f"FixedK({self.k})"


class ConfidenceHead:
    """Logistic regression ``P(accept | earlier tokens accepted) = sigmoid(bias + w . (x - mean) / std)``."""

    def __init__(self, weights: Sequence[float], bias: float, means: Sequence[float], stds: Sequence[float],
                 threshold: float = DEFAULT_THRESHOLD, training: dict[str, Any] | None = None) -> None:
        d = len(DERIVED_NAMES)
        self.weights = np.asarray(weights, dtype=np.float64)
        self.means = np.asarray(means, dtype=np.float64)
        self.stds = np.asarray(stds, dtype=np.float64)
        if not (self.weights.shape == self.means.shape == self.stds.shape == (d,)):
            raise ValueError(f"weights, means and stds must each have {d} entries ({', '.join(DERIVED_NAMES)})")
        if not np.all(np.isfinite(self.weights)) or not math.isfinite(bias) or np.any(self.stds <= 0):
            raise ValueError("weights and bias must be finite and stds positive")
        self.bias, self.threshold = float(bias), float(threshold)
        self.training = dict(training or {})
        # folded standardisation: z = intercept + coef . x (the same affine map, fewer operations per token)
        self._coef = (self.weights / self.stds).tolist()
        self._intercept = self.bias - float(np.sum(self.weights * self.means / self.stds))

    # -- prediction ---------------------------------------------------------------------------------
    def accept_probs(self, raw: np.ndarray) -> np.ndarray:
        """[N, 4] raw feature rows -> [N] acceptance probabilities (the batch path: training, simulation)."""
        z = ((design_matrix(raw) - self.means) / self.stds) @ self.weights + self.bias
        return _sigmoid(z)

    def accept_prob(self, features: TokenFeatures) -> float:
        """One token's probability in plain Python (equal to ``accept_probs`` up to float rounding)."""
        z = self._intercept + sum(c * v for c, v in zip(self._coef, derived_row(features)))
        return 0.5 * (1.0 + math.tanh(0.5 * z))

    def keep_count(self, features: Sequence[TokenFeatures], threshold: float | None = None) -> int:
        """How many leading tokens of one proposal ``trim`` keeps."""
        t = self.threshold if threshold is None else threshold
        cumulative, n = 1.0, 0
        for f in features:
            cumulative *= self.accept_prob(f)  # non-increasing: stop at the first token below the threshold
            if cumulative < t:
                break
            n += 1
        return n

    def trim(self, proposal: Proposal, threshold: float | None = None) -> Proposal:
        """The longest prefix whose cumulative predicted acceptance is ``>= threshold`` (default: the head's)."""
        n = self.keep_count(proposal.features, threshold)
        return proposal if n == len(proposal.tokens) else proposal.trimmed(n)

    # -- training -------------------------------------------------------------------------------------
    @classmethod
    def fit(cls, raw: np.ndarray, y: np.ndarray, l2: float = 1.0, threshold: float = DEFAULT_THRESHOLD,
            max_iter: int = 50, tol: float = 1e-10) -> ConfidenceHead:
        """Fit by Newton's method on the L2-penalised log-loss (sum over rows, ``l2/2 * |w|^2``, bias free).

        ``raw``: [N, 4] rows; ``y``: [N] 0/1. Needs N >= 1. Deterministic; stops when the step is below
        ``tol`` or after ``max_iter`` iterations (logged if so).
        """
        x = design_matrix(raw)
        y = np.asarray(y, dtype=np.float64).reshape(-1)
        if len(x) == 0 or len(x) != len(y):
            raise ValueError(f"need matching non-empty X and y, got {len(x)} and {len(y)} rows")
        if l2 < 0:
            raise ValueError(f"l2 must be >= 0, got {l2}")
        means = x.mean(axis=0)
        stds = x.std(axis=0)
        stds = np.where(stds < _MIN_STD, 1.0, stds)
        xs = np.column_stack([(x - means) / stds, np.ones(len(x))])  # [N, d + 1], bias last
        d = xs.shape[1]
        penalty = np.full(d, float(l2))
        penalty[-1] = 1e-8  # the bias is (practically) unpenalised; keeps the Hessian definite on constant data
        theta = np.zeros(d)
        iterations, converged = 0, False
        while iterations < max_iter and not converged:
            iterations += 1
            p = _sigmoid(xs @ theta)
            grad = xs.T @ (p - y) + penalty * theta
            hess = (xs * (p * (1.0 - p))[:, None]).T @ xs + np.diag(penalty)
            step = np.linalg.solve(hess + 1e-9 * np.eye(d), grad)
            theta -= step
            converged = bool(np.max(np.abs(step)) < tol)
        if not converged:
            logger.warning("confidence head: Newton did not converge in %d iterations", max_iter)
        return cls(theta[:-1], float(theta[-1]), means, stds, threshold,
                   {"num_rows": int(len(y)), "base_rate": float(y.mean()), "l2": float(l2), "iterations": iterations})

    # -- persistence ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": HEAD_VERSION, "kind": "logistic", "feature_names": list(DERIVED_NAMES),
                "weights": self.weights.tolist(), "bias": self.bias, "means": self.means.tolist(),
                "stds": self.stds.tolist(), "threshold": self.threshold, "training": self.training}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConfidenceHead:
        if not isinstance(data, dict) or data.get("version") != HEAD_VERSION or data.get("kind") != "logistic":
            raise ValueError(f"not a version-{HEAD_VERSION} logistic confidence head")
        if tuple(data.get("feature_names", ())) != DERIVED_NAMES:
            raise ValueError(f"head features {data.get('feature_names')} != this code's {list(DERIVED_NAMES)}")
        try:
            return cls(data["weights"], float(data["bias"]), data["means"], data["stds"], float(data["threshold"]),
                       data.get("training"))
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed confidence head: {err!r}") from err

    def save(self, path: str | Path) -> None:
        """Write the head as indented JSON (atomically: a temporary file renamed over ``path``)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> ConfidenceHead:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not JSON: {err}") from err
        return cls.from_dict(data)

    def __repr__(self) -> str:
        return f"ConfidenceHead(threshold={self.threshold}, rows={self.training.get('num_rows')})"


def load_head(path: str | Path | None, default_k: int = DEFAULT_K) -> ConfidenceHead | FixedK:
    """The head at ``path``; ``None``, ``""`` or a missing file -> ``FixedK(default_k)`` with a warning."""
    if path is None or str(path) == "":
        logger.warning("no confidence head configured: verifying the first %d drafted tokens", default_k)
        return FixedK(default_k)
    if not Path(path).is_file():
        logger.warning("confidence head %s not found: verifying the first %d drafted tokens", path, default_k)
        return FixedK(default_k)
    head = ConfidenceHead.load(path)
    logger.info("confidence head %s loaded: threshold %.3g, trained on %s rows", path, head.threshold,
                head.training.get("num_rows"))
    return head
