"""`tokenmill explain`: the toy example's printed weights, outputs and next token against values worked out by hand
(positions count from 1 in the heads' rules), and on a tiny model the cached and recomputed logits it prints."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.cli import main

pytest_plugins = ["tests.server_fixtures"]


def test_the_toy_example_by_hand(capsys: pytest.CaptureFixture) -> None:
    assert main(["explain", "--toy-only"]) == 0
    out = capsys.readouterr().out
    so = out.split("      so:\n", 1)[1]
    # "so" (position 4): head 1 the even positions 2 and 4 (weather 20, so 5), head 2 itself, head 3 Today, head 4
    # all four: 12.5, 5, 10, 9
    assert "head 1 weights [0.000 0.500 0.000 0.500]  -> output 12.5" in so
    assert "head 2 weights [0.000 0.000 0.000 1.000]  -> output 5" in so
    assert "head 3 weights [1.000 0.000 0.000 0.000]  -> output 10" in so
    assert "head 4 weights [0.250 0.250 0.250 0.250]  -> output 9" in so
    assert "context of 'so' (the four heads' outputs): 12.5, 5, 10, 9" in out
    # logits = context x projection: nice 12.5*.1 + 5*.2 + 10*.1 + 9*.2 = 5.05; warm 4.55; delicious -0.8
    assert "logits: nice=5.050, warm=4.550, delicious=-0.800  -> next token: nice" in out
    # "nice" (8) at position 5: heads give (20 + 5) / 2, 8, 10, (10 + 20 + 1 + 5 + 8) / 5
    assert "with the cache (1 row against 4 cached keys/values): context 12.5, 8, 10, 8.8" in out
    assert "recomputing all 5 rows without it:                  context 12.5, 8, 10, 8.8" in out
    assert "the same: True" in out


@pytest.mark.slow
def test_a_tiny_model_cached_equals_recomputed(chat_model_dir: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    from tokenmill.explain import print_model
    plot = tmp_path / "explain.png"
    got = print_model(chat_model_dir, "Today the weather is so", 3, head=1, layer=-1, plot=str(plot))
    out = capsys.readouterr().out
    assert len(got["steps"]) == 3 and plot.stat().st_size > 0
    for step in got["steps"]:
        assert step["max_abs_diff"] < 1e-4 and step["same_next"]
        assert step["weights_sum"] == pytest.approx(1.0, abs=1e-5)
    assert out.count("logits, cached | recomputed") == 3 and "K and V of each layer" in out
