"""An OpenEnv environment for the tests, written with openenv-core's own classes: `Tally`, a text game of three
turns (the policy's turn is the action; the reward, at the end, is the letters it said over the three turns, mod 5,
over 4), and `Walk`, an environment of structured actions (a step of dx, dy; reward 1 on reaching (2, 1)); their
clients; and `serve`, which serves one on 127.0.0.1 with openenv's own app. The stage tests write this file into
their working folder, as a user's module."""

import os
import socket
import threading
import time
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.pop("ENABLE_WEB_INTERFACE", None)

from openenv.core import EnvClient  # noqa: E402
from openenv.core.client_types import StepResult  # noqa: E402
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app  # noqa: E402
from pydantic import Field  # noqa: E402

TURNS = 3
LOG: list[tuple[str, str, float]] = []  # (episode id, what the policy said, when): what the server saw


def tally_reward(said: list[str]) -> float:
    return (sum(sum(c.isalpha() for c in s) for s in said) % 5) / 4


class Say(Action):
    message: str = Field(..., description="what the player says")


class Heard(Observation):
    text: str = ""


class Tally(Environment[Say, Heard, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True
    DELAY = 0.0  # seconds each step takes after it is logged (a test sets it, to show steps of sessions overlap)
    TURNS = TURNS  # a game's turns (a stage test on a model of 128 positions sets 2)

    def reset(self, seed=None, episode_id=None, **kwargs: Any) -> Heard:
        self._state, self.said = State(episode_id=episode_id or str(id(self)), step_count=0), []
        return Heard(text=" (three turns)")

    def step(self, action: Say, timeout_s=None, **kwargs: Any) -> Heard:
        self._state.step_count += 1
        self.said.append(action.message)
        LOG.append((self._state.episode_id, action.message, time.perf_counter()))
        time.sleep(self.DELAY)
        if self._state.step_count >= self.TURNS:
            return Heard(text="over", done=True, reward=tally_reward(self.said))
        return Heard(text=f"turn {self._state.step_count}: {len(action.message)} characters")

    @property
    def state(self) -> State:
        return self._state


class Client:
    """What both clients do alike: an action sent as its fields, an observation of `observation`'s fields."""

    observation: type

    def _step_payload(self, action) -> dict:
        return action.model_dump()

    def _parse_result(self, payload: dict) -> StepResult:
        reward, done = payload.get("reward"), payload.get("done", False)
        obs = self.observation(**payload.get("observation", {}), reward=reward, done=done)
        return StepResult(observation=obs, reward=reward, done=done)

    def _parse_state(self, payload: dict) -> State:
        return State(**payload)


class TallyClient(Client, EnvClient[Say, Heard, State]):
    observation = Heard


class StepAction(Action):
    """Take a step on the grid."""

    dx: int = Field(..., description="columns to move")
    dy: int = Field(..., description="rows to move")


class Where(Observation):
    x: int = 0
    y: int = 0


class Walk(Environment[StepAction, Where, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, **kwargs: Any) -> Where:
        self._state, self.at = State(step_count=0), (0, 0)
        return Where(x=0, y=0)

    def step(self, action: StepAction, timeout_s=None, **kwargs: Any) -> Where:
        self.at = (self.at[0] + action.dx, self.at[1] + action.dy)
        done = self.at == (2, 1)
        return Where(x=self.at[0], y=self.at[1], done=done, reward=1.0 if done else 0.0)

    @property
    def state(self) -> State:
        return self._state


class WalkClient(Client, EnvClient[StepAction, Where, State]):
    observation = Where


def serve(env: type, action: type, observation: type, sessions: int = 64):
    """The environment served on 127.0.0.1 by openenv's app under uvicorn, in a thread: (its URL, a stop function)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_fastapi_app(env, action, observation, max_concurrent_envs=sessions)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws="websockets"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the OpenEnv server did not start")
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{port}", stop
