"""Sequential temperature scaling (DSpark paper, section 3.2.1) of the confidence head.

The scheduler reads prefix survival ``a_j = prod_(i<=j) c_i``, so what must be calibrated is
the running product, position by position: for k = 1..g in order, the temperature T_k of
``c_k = sigmoid(logit_k / T_k)`` is the grid value that minimises the expected calibration error
of ``a_k`` against whether the first k drafts were all accepted, T_1..T_(k-1) held fixed.
"""

from __future__ import annotations

import numpy as np

GRID = np.exp(np.linspace(np.log(0.25), np.log(8.0), 61))


def expected_calibration_error(prob: np.ndarray, outcome: np.ndarray, bins: int = 15) -> float:
    """Equal-width-bin ECE of predicted probabilities against 0/1 outcomes."""
    which = np.minimum((prob * bins).astype(int), bins - 1)
    ece = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            ece += sel.mean() * abs(prob[sel].mean() - outcome[sel].mean())
    return float(ece)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def sequential_temperatures(
    logits: np.ndarray, accepted: np.ndarray
) -> tuple[list[float], list[float], list[float]]:
    """logits [N, g] confidence logits, accepted [N, g] 0/1 "the first k+1 drafts survived".

    Returns (temperatures, ECE of the running product per position before, and after).
    """
    n, g = logits.shape
    temps: list[float] = []
    before, after = [], []
    running_raw = np.ones(n)
    running = np.ones(n)
    for k in range(g):
        running_raw = running_raw * _sigmoid(logits[:, k])
        before.append(expected_calibration_error(running_raw, accepted[:, k]))
        errors = [expected_calibration_error(running * _sigmoid(logits[:, k] / t), accepted[:, k])
                  for t in GRID]
        t = float(GRID[int(np.argmin(errors))])
        temps.append(t)
        running = running * _sigmoid(logits[:, k] / t)
        after.append(min(errors))
    return temps, before, after
