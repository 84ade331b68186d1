"""Fixed-seed realistic simulations checked against stored summaries.

Regenerate after an intended model change with ``BTBCTL_UPDATE_GOLDEN=1 pytest tests/test_golden_realistic.py``
and explain the change in the commit message.
"""

import json
import os
from pathlib import Path

from btbctl.engine.config import ClusterConfig
from btbctl.engine.constants import BtbConstants
from btbctl.engine.policies import DEFAULT_POLICIES
from btbctl.engine.sim import simulate
from btbctl.engine.trace.generate import BurstedParams, generate_bursted
from helpers import assert_close

GOLDEN = Path(__file__).parent / "golden" / "realistic_small.json"
CASES = {
    "bursted_60s": BurstedParams(
        bursts=2, burst_size=60, decoys=6, prefix_tokens=16384, spread_s=6.0, decoy_end_s=120.0
    ),
    "bursted_1s": BurstedParams(
        bursts=2, burst_size=60, decoys=6, prefix_tokens=16384, spread_s=1.0, decoy_end_s=120.0
    ),
}
CLUSTER = ClusterConfig()
CONSTANTS = BtbConstants(prefix_blocks=64)


def compute() -> dict:
    out = {}
    for name, params in CASES.items():
        trace = generate_bursted(params, seed=7)
        out[name] = {pol: simulate(trace, pol, CLUSTER, CONSTANTS, seed=7).summary() for pol in DEFAULT_POLICIES}
    return out


def test_realistic_summaries_match_golden():
    got = json.loads(json.dumps(compute()))
    if os.environ.get("BTBCTL_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert_close(got, want)


def test_golden_cases_tell_the_policies_apart():
    """Guards the goldens against being trivially equal: the burst cases must separate BTB from its peers."""
    want = json.loads(GOLDEN.read_text())
    for case in CASES:
        res = want[case]
        assert res["btb"]["replications"] > 0
        assert res["least_load"]["replications"] == 0
        assert res["btb"]["recomputed_prefix_tokens"] < res["least_load"]["recomputed_prefix_tokens"]
