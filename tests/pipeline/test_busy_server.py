"""A busy Prefect server is survived, not failed on: a server made busy on purpose (a proxy in front of a real
`prefect server` that answers 503 as a loaded SQLite server does) is retried through by `gptforge deploy` and by
Prefect's own `prefect deploy` with gptforge's settings (pipeline/prefect_env.py), where Prefect's default gives up.
On a server of its own: the team module's, under its workers and flows, is busy for real."""

import subprocess

import pytest

from tests.conftest import ROOT
from tests.helpers import config
from tests.pipeline.test_team import PIPE, POOLS, PREFECT, Team

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    t = Team(tmp_path_factory.mktemp("busy"))
    try:
        yield t
    finally:
        t.close()


class Busy:
    """A proxy in front of a Prefect server that answers its first `refusals` requests to create a deployment with
    503, as a loaded SQLite server does when a write waits on its lock (Retry-After: 0.1 s, so that the client's
    backoff costs the test nothing); every other request passes through."""

    def __init__(self, upstream: str, refusals: int):
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        self.refused, busy = 0, self
        up = urlsplit(upstream)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "POST" and self.path.rstrip("/").endswith("/deployments") and \
                        busy.refused < refusals:
                    busy.refused += 1
                    reply = b'{"exception_message": "Service Unavailable"}'
                    self.send_response(503)
                    for k, v in (("Content-Type", "application/json"), ("Retry-After", "0.1"),
                                 ("Content-Length", str(len(reply)))):
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(reply)
                    return
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=120)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "connection", "accept-encoding")}
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}{up.path}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_busy_server_is_retried_and_the_infra_template_deploys_the_same_layout(server, tmp_path):
    """Six 503s in a row for one deployment (one more than Prefect's default of 5 retries survives): `gptforge deploy`
    and `prefect deploy` both retry through them with gptforge's settings (pipeline/prefect_env.py), and the same
    deploy with Prefect's default gives up. infra/prefect.yaml, deployed with Prefect's own CLI, gives the pipeline,
    its watch flow and a stage deployment for each pool."""
    from gptforge.pipeline import prefect_env

    _, path = config(tmp_path, *PIPE, *POOLS)
    busy = Busy(server.url, refusals=6)
    try:
        env = {**server.env, "PREFECT_API_URL": busy.url}
        failed = server.gptforge("deploy", "-c", str(path), "--name", "busy-default", check=False,
                               env={**env, "PREFECT_CLIENT_MAX_RETRIES": "5"})
        assert failed.returncode != 0 and busy.refused == 6 and "503" in failed.stdout + failed.stderr
        busy.refused = 0
        # the CLI in an environment without the suite's Prefect settings (tests/conftest.py applied them to this
        # process): what it retries with is its own
        bare = {k: v for k, v in env.items() if k not in prefect_env.SETTINGS}
        assert "PREFECT_CLIENT_MAX_RETRIES" not in bare
        server.gptforge("deploy", "-c", str(path), "--name", "busy-test", env=bare)
        assert busy.refused == 6
        busy.refused = 0
        out = subprocess.run(PREFECT + ["--no-prompt", "deploy", "--prefect-file", "infra/prefect.yaml", "--all"],
                             env={**env, "GPTFORGE_HOME": str(ROOT)}, cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0 and busy.refused == 6, out.stdout[-3000:] + out.stderr[-3000:]
    finally:
        busy.close()
    with server.api() as client:
        names = {f"{client.read_flow(d.flow_id).name}/{d.name}": d for d in client.read_deployments()}
    assert {"gptforge-pipeline/nightly", "gptforge-watch/watch", "gptforge-stage/cpu", "gptforge-stage/gpu",
            "gptforge-pipeline/busy-test"} <= set(names)
    assert names["gptforge-stage/gpu"].work_pool_name == "gpu" and "gptforge-pipeline/busy-default" not in names
