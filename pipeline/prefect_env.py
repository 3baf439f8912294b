"""The Prefect settings of every gptforge process, and of each Prefect server, worker, flow run and CLI it starts
(they inherit the environment, or get these as a deployment's job variables). A setting the user exported wins.

A busy server is survived, not failed on. Prefect's server answers 503 when its database is busy: SQLite's lock
waited on past its busy timeout, or a Postgres statement past PREFECT_SERVER_DATABASE_TIMEOUT (10 s by default).
Prefect's client retries a 503 (and 429, 502, 408) up to PREFECT_CLIENT_MAX_RETRIES times with a doubling backoff:
the default 5 gives up after about a minute of a loaded server, as `prefect deploy` did on a slow 2-core machine
under the test suite. Here a client retries 7 times (2 + 4 + ... + 128 s: about four minutes), and a server that
gptforge starts gives a statement a minute."""

import os

HEARTBEAT_SECONDS = 30  # so that the automation `gptforge deploy` installs can mark a vanished run Crashed

SETTINGS = {
    # No internet: no telemetry.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_LEVEL": "INFO",
    "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_SECONDS),
    # The first start of the ephemeral server migrates its SQLite database: slow on 2 cores.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_CLIENT_MAX_RETRIES": "7",
    "PREFECT_SERVER_DATABASE_TIMEOUT": "60",
}


def apply() -> None:
    """Set each of SETTINGS in this process's environment, unless already set."""
    for key, value in SETTINGS.items():
        os.environ.setdefault(key, value)
