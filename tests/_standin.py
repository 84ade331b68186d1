"""A stand-in server for launcher tests (not a test module).

Run as a program with any argv; it reads ``--host`` and ``--port`` from it (defaults 127.0.0.1 and a free port) and
serves ``GET /health`` (200) and ``GET /argv`` (its argv as JSON). Started as a node agent (``-m btbctl agent``), it
serves them on ``--control HOST:PORT`` instead and prints the agent's ready line (``ready peer P control HOST:PORT
socket S``). Behaviour switches, from the environment:

* ``STANDIN_ARGV_FILE``: write ``sys.argv`` (JSON list) there before anything else.
* ``STANDIN_READY_LINE=1``: print ``ready http://HOST:PORT`` once listening.
* ``STANDIN_EXIT=<code>``: print a message and exit with that status at once.
* ``STANDIN_IGNORE_TERM=1``: ignore SIGTERM (only SIGKILL stops it).
* ``STANDIN_CHILD=1``: start a child process (same process group) that sleeps; its pid goes to
  ``STANDIN_CHILD_PID_FILE``.
* ``STANDIN_DELAY_S``: seconds to wait before listening.
"""

import json
import os
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _arg(name, default):
    argv = sys.argv
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
    return default


def main():
    if os.environ.get("STANDIN_ARGV_FILE"):
        with open(os.environ["STANDIN_ARGV_FILE"], "w") as f:
            json.dump(sys.argv, f)
    if os.environ.get("STANDIN_EXIT"):
        print("stand-in: asked to fail", flush=True)
        sys.exit(int(os.environ["STANDIN_EXIT"]))
    if os.environ.get("STANDIN_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("STANDIN_CHILD") == "1":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["STANDIN_CHILD_PID_FILE"], "w") as f:
            f.write(str(child.pid))
    time.sleep(float(os.environ.get("STANDIN_DELAY_S", "0")))
    agent = sys.argv[1:4] == ["-m", "btbctl", "agent"]
    if agent:
        host, _, p = _arg("--control", "127.0.0.1:0").rpartition(":")
        port = int(p)
    else:
        host = _arg("--host", "127.0.0.1")
        port = int(_arg("--port", "0"))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                body = b"ok"
            elif self.path == "/argv":
                body = json.dumps(sys.argv).encode()
            else:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer((host, port), Handler)
    if agent:
        import socket

        peer, sock = _arg("--peer", "?"), _arg("--socket", "?")
        # a copy port that takes connections (and nothing more), as `btbctl status` probes it
        phost, _, pport = peer.rpartition(":")
        if pport.isdigit():
            listener = socket.create_server((phost.strip("[]") or "127.0.0.1", int(pport)))
            peer = f"{phost}:{listener.getsockname()[1]}"
        print(f"ready peer {peer} control {host}:{srv.server_address[1]} socket {sock}", flush=True)
    elif os.environ.get("STANDIN_READY_LINE") == "1":
        print(f"ready http://{host}:{srv.server_address[1]}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
