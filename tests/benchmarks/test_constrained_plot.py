"""constrained.png from a report of some constraints only (no headline): the floors still come from the report."""

from benchmarks.constrained import FLOORS
from benchmarks.constrained_plot import plot


def _report(names: list[str]) -> dict:
    result = {
        "modes": {mode: {"tokens_per_s": 10.0} for mode in ("constrained", "unconstrained", "constrained_plain")},
        "ratio_median": {"vs_unconstrained": 0.9, "vs_constrained_plain": 1.6},
        "ratio_per_run": {"vs_unconstrained": [0.85, 0.95], "vs_constrained_plain": [1.5, 1.7]},
    }
    return {
        "pair": "demo",
        "gamma": 4,
        "gamma_policy": "fixed",
        "headline": None,
        "floors": FLOORS,
        "constraints": {name: result for name in names},
    }


def test_plot_without_a_headline(tmp_path):
    path = plot(_report(["json_schema"]), tmp_path / "constrained.png")
    assert path.read_bytes().startswith(b"\x89PNG")
