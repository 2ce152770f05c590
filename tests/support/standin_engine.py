"""A stand-in for `python -m engine` in lifecycle tests that must not depend on a model.

It answers /health and /generate like the engine, enforces API_KEY from the environment, and
records its argv and environment (minus secrets' values) to $STANDIN_RECORD if set.
"""
import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
host = args[args.index("--hostname") + 1] if "--hostname" in args else "0.0.0.0"
key = os.environ.get("API_KEY")
if os.environ.get("STANDIN_RECORD"):  # "{port}" in the path: one record per engine of a several-models job
    with open(os.environ["STANDIN_RECORD"].replace("{port}", str(port)), "w") as fh:
        json.dump({"argv": sys.argv, "has_api_key": bool(key), "pid": os.getpid(),
                   "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}, fh)


class Handler(BaseHTTPRequestHandler):
    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, {}) if self.path == "/health" else self._send(404, {"error": "not found", "error_type": "not_found"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if key and self.headers.get("Authorization") != f"Bearer {key}":
            return self._send(401, {"error": "Unauthorized", "error_type": "unauthorized"})
        self._send(200, {"generated_text": " world"})

    def log_message(self, *a):
        pass


attempts = int(args[args.index("--port-attempts") + 1] if "--port-attempts" in args else
               os.environ.get("PORT_ATTEMPTS", "1"))
for candidate in range(port, port + attempts):   # as the engine does: the port, or the next free one
    try:
        server = ThreadingHTTPServer((host, candidate), Handler)
        break
    except OSError:
        if candidate == port + attempts - 1:
            raise
port = server.server_address[1]
if "--ready-file" in args:  # as the engine does: written once the port is bound
    with open(args[args.index("--ready-file") + 1], "w") as fh:
        json.dump({"host": host, "port": port, "pid": os.getpid()}, fh)
signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(SystemExit(0)))
print(f"stand-in engine on {host}:{port}", file=sys.stderr, flush=True)
try:
    server.serve_forever()
except SystemExit:
    pass
