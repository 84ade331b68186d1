"""`btbctl tui` option checks that need no screen."""

import pytest

from helpers import run_cli


@pytest.mark.parametrize(
    "flag", [["--threshold", "3"], ["--prefix-blocks", "8"], ["--seed", "1"], ["--speed", "2"], ["--model", "qwen3-8b"]]
)
def test_simulation_options_without_sim_are_refused(flag, tmp_path, capsys):
    code, out, err = run_cli(capsys, "tui", "--run-dir", str(tmp_path), *flag)
    assert code == 2
    assert "need --sim" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:8001", "file:///etc/passwd", "127.0.0.1:8001"])
def test_control_api_urls_other_than_http_are_refused(url, tmp_path, capsys):
    code, out, err = run_cli(capsys, "tui", "--run-dir", str(tmp_path), "--url", url)
    assert code == 2
    assert "http or https only" in err and len(err.strip().splitlines()) == 1
