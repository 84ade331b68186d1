"""A gateway in a child process under a lowered descriptor limit (``RLIMIT_NOFILE`` soft = hard = ``argv[1]``).

Usage: ``python tests/gateway_child.py NOFILE CONFIG_JSON``; prints ``ready <data_url> <control_url>`` once both
listeners accept connections, logs to stderr, and runs until SIGTERM.
"""

from __future__ import annotations

import json
import logging
import resource
import sys

from btbctl.engine.gateway import GatewayConfig
from btbctl.engine.gateway.server import run_gateway


def main() -> None:
    nofile = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
    cfg = GatewayConfig(**json.loads(sys.argv[2]))
    run_gateway(cfg, on_ready=lambda gw: print(f"ready {gw.data_url} {gw.control_url}", flush=True))


if __name__ == "__main__":
    main()
