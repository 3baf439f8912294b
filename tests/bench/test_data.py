"""The data benches, shrunk: tokenize and curate."""

import re

import pytest

from tests.bench.run import bench

pytestmark = pytest.mark.slow


def test_tokenize_bench(tmp_path):
    out = bench("tokenize_bench.py", "--gb", "0.003", "--workers", "2")
    assert re.search(r"ratio gptforge/baseline tokens/s: [\d.]+x \(target >= 1.5x\)", out), out
    ours, base = (int(re.search(rf"^{side} +([\d,]+) tokens in", out, re.M).group(1).replace(",", ""))
                  for side in ("gptforge", "baseline"))
    assert ours == base > 0, out  # both sides wrote the same tokens: each document's ids and its EOS


def test_curate_bench():
    """bench/curate.py shrunk: the stage and datatrove's own executor on the same planted corpus, their ratio, and
    near-duplicate recall and precision against exact Jaccard (the figures at 1 GB, and the stage's memory at two
    sizes, are bench/RESULTS.md's: at 3 MB the memory is the processes' own, whatever the corpus)."""
    out = bench("curate.py", "--gb", "0.002", "--workers", "2", "--no-tenth")
    assert re.search(r"gptforge +[\d,]+ documents in .* peak [\d.]+ GiB", out), out
    assert re.search(r"ratio gptforge/baseline documents/s: [\d.]+x \(target >= 1.0x\)$", out, re.M), out
    recall, precision = map(float, re.search(r"recall ([\d.]+) .* precision ([\d.]+)", out).groups())
    assert recall >= 0.9 and precision >= 0.95, out
