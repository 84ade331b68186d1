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
* ``STANDIN_STAY_UP_ON_BIND_ERROR=1``: when its port is taken, log the bind error as uvicorn does (SGLang's HTTP
  server: asyncio's message) and stay up, as SGLang's process does while its scheduler children live.

Registration (replication l3): a worker whose HiCache extra config names ``agent_socket`` and ``worker_url`` writes
that URL into the folder ``<agent_socket>.workers`` (as a real store names it in its hello); an agent started with
``--gateway URL`` announces itself there every 0.3 s, signed like a real agent, naming the URLs in that folder.
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


def _note_worker():
    """A worker: leave its ``worker_url`` where the stand-in agent of its ``agent_socket`` reads it."""
    extra = _arg("--hicache-storage-backend-extra-config", None)
    if extra is None:
        return
    cfg = json.loads(extra)
    if cfg.get("worker_url") and cfg.get("agent_socket"):
        d = cfg["agent_socket"] + ".workers"
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, str(abs(hash(cfg["worker_url"])))), "w") as f:
            f.write(cfg["worker_url"])


def _announce_forever(gateway, control_url, peer, sock):
    """An agent: announce to ``gateway`` every 0.3 s (signed with its node key, from its ``--secret-file``)."""
    import urllib.request

    from btbctl.engine.replication.credentials import parse_credentials
    from btbctl.engine.replication.registration import REGISTER_PATH, SIGNATURE_HEADER, Announcement, sign

    with open(_arg("--secret-file", ""), "rb") as f:
        cred = parse_credentials(f.read(), _arg("--agent-id", None), "--secret-file")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while True:
        d = sock + ".workers"
        workers = []
        if os.path.isdir(d):
            for name in sorted(os.listdir(d)):
                with open(os.path.join(d, name)) as f:
                    workers.append(f.read().strip())
        body = Announcement(cred.agent_id, cred.agent_id, peer, control_url, tuple(workers), 3.0, time.time()).body()
        req = urllib.request.Request(
            gateway.rstrip("/") + REGISTER_PATH,
            data=body,
            headers={SIGNATURE_HEADER: sign(cred.node_key, body), "Content-Type": "application/json"},
        )
        try:
            opener.open(req, timeout=2).read()
        except OSError:
            pass
        time.sleep(0.3)


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

    try:
        srv = ThreadingHTTPServer((host, port), Handler)
    except OSError as e:
        if os.environ.get("STANDIN_STAY_UP_ON_BIND_ERROR") != "1":
            raise
        msg = f"error while attempting to bind on address {(host, port)!r}: {str(e.strerror).lower()}"
        print(f"ERROR:    [Errno {e.errno}] {msg}", flush=True)
        while True:
            time.sleep(60)
    if agent:
        import socket

        peer, sock = _arg("--peer", "?"), _arg("--socket", "?")
        # a copy port that takes connections (and nothing more), as `btbctl status` probes it
        phost, _, pport = peer.rpartition(":")
        if pport.isdigit():
            listener = socket.create_server((phost.strip("[]") or "127.0.0.1", int(pport)))
            peer = f"{phost}:{listener.getsockname()[1]}"
        print(f"ready peer {peer} control {host}:{srv.server_address[1]} socket {sock}", flush=True)
        if _arg("--gateway", None):
            import threading

            args = (_arg("--gateway", None), f"http://{host}:{srv.server_address[1]}", peer, sock)
            threading.Thread(target=_announce_forever, args=args, daemon=True).start()
    else:
        _note_worker()
        if os.environ.get("STANDIN_READY_LINE") == "1":
            print(f"ready http://{host}:{srv.server_address[1]}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
