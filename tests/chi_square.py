"""Pearson's chi-square test of sampled tokens against exact probabilities, with sparse cells pooled: what the
distribution tests (the contract suite's, the twin's) hold a stack's sampled output to."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

MIN_EXPECTED = 5.0


def pooled_chisquare(observed: dict, probabilities: dict, total: int) -> tuple[float, float, int]:
    """Chi-square of observed counts over cells with the given probabilities; every cell expected fewer than
    MIN_EXPECTED times, and every observation outside the cells, goes to one pooled cell."""
    cells = sorted((cell for cell, p in probabilities.items() if p * total >= MIN_EXPECTED), key=str)
    expected = [probabilities[cell] * total for cell in cells]
    counts = [observed.get(cell, 0) for cell in cells]
    rest_expected, rest_count = total - sum(expected), total - sum(counts)
    if rest_expected >= MIN_EXPECTED:
        expected.append(rest_expected)
        counts.append(rest_count)
    else:  # too little left to stand alone: fold it into the smallest cell
        smallest = int(np.argmin(expected))
        expected[smallest] += rest_expected
        counts[smallest] += rest_count
    statistic, p_value = chisquare(counts, np.array(expected) * (sum(counts) / sum(expected)))
    return float(statistic), float(p_value), len(counts)
