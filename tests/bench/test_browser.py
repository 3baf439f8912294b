"""The browser benches (headless Chromium): the report and the team UI."""

import pytest

from tests.bench.run import BROWSER, bench

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not BROWSER, reason="needs chromium and chromium-driver (apt) and selenium (.[browser])")
@pytest.mark.parametrize("script", ["report_browser.py", "team_ui.py"])
def test_browser_benches(script, tmp_path):
    pytest.importorskip("selenium")
    bench(script, "--out", str(tmp_path))
    assert any(tmp_path.glob("*.png"))
