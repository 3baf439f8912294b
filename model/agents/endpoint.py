"""The policy behind an OpenAI-compatible endpoint, for the environments whose own harness drives an episode and
reaches the model as it reaches any (verifiers' harnesses; most agent harnesses): `/v1/chat/completions` and
`/v1/completions` on 127.0.0.1 (a free port unless given), served by the rollout process (the training process in
sync mode, a rollout worker in async mode) for the policy's current weights, as long as a batch's episodes run.

Token-exact, as gptforge's own episodes are (gptforge.model.agents.episode): each episode is a session, its address
`/s/<session>/v1`. Its first request's conversation is rendered by the chat template with the generation prompt;
each later one must extend the conversation so far (the policy's turns as the endpoint answered them, whatever the
harness echoes back), and only what it adds (tool results, a user turn) is tokenized, as the tokens between turns;
the policy's turns stay the ids it sampled. A completions request's prompt (text or token ids) must likewise extend
the session's ids. Each answer carries the ids sampled and their log-probabilities, as vLLM's server does
(`choices[0].token_ids`, `prompt_token_ids`, `logprobs.content`), so that a harness that records them has the ids
the trainer trains.

The requests of every open session are sampled together: the endpoint waits until each open session has asked (or
`window_s` has passed since the first request), then samples the batch at once, as gptforge's own rollouts sample a
turn of every open episode. A request past `max_turns`, past the length budget, or after a turn cut by its budget
is answered with an error (HTTP 400), which the harness records; the episode ends there.

A request the endpoint cannot read (not JSON, not an object, a field of the wrong type, a negative or oversized
number, a token id outside the vocabulary) is answered 400 with the reason, before anything of the session changes:
the harness may correct it. Every request carries the run's key (`Authorization: Bearer <key>`, a fresh one a
process, handed to the harnesses gptforge drives), or is answered 401: another user of the host cannot drive a
session. A sampler that fails answers every request of its batch (500, its error) and the failure goes on to the
rollout process; a request that waits past `wait_s` for its turn is answered 503. The endpoint binds to 127.0.0.1
unless told otherwise (`preference.endpoint_host`), which is warned about.

On a GPU, vLLM's own server takes this one's place behind the same seam (the engine, gptforge.model.sampling.engine).
"""

from __future__ import annotations

import json
import queue
import re
import secrets
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gptforge.model.agents.calls import parse
from gptforge.model.agents.trajectory import Episode, Sampler, between_turns

PATH = re.compile(r"^/s/(?P<session>[\w-]+)/v1/(?P<kind>chat/completions|completions|models)$")


class Refused(Exception):
    """A request the session cannot take: the episode ends with `ended`."""

    def __init__(self, message: str, ended: str):
        super().__init__(message)
        self.ended = ended


class Invalid(Exception):
    """A request the endpoint cannot read: answered 400, the session unchanged."""


class SamplerFailed(Exception):
    """The sampler raised while this request's batch was sampled."""


@dataclass
class Session:
    """One episode's conversation with the endpoint."""

    key: str
    episode: Episode | None = None
    tools: list[dict] | None = None
    open: bool = True  # whether it may still ask (the driver closes it when its episode ends)
    cut: bool = False  # its last turn ran out of budget before its end-of-turn token


@dataclass
class Request:
    sequence: list[int]
    budget: int
    done: threading.Event = field(default_factory=threading.Event)
    turn: list[int] | None = None
    error: str | None = None  # the sampler's, where it failed on this request's batch


class Endpoint:
    """An OpenAI-compatible endpoint over a sampler, one session an episode (see the module)."""

    def __init__(self, tokenizer, fmt: str, max_turns: int, max_length: int, stop_ids: set[int],
                 host: str = "127.0.0.1", port: int = 0, model: str = "policy", window_s: float = 0.05,
                 wait_s: float = 600.0):
        self.tokenizer, self.fmt, self.max_turns, self.max_length = tokenizer, fmt, max_turns, max_length
        self.stop_ids, self.model, self.window_s, self.wait_s = stop_ids, model, window_s, wait_s
        self.vocab = len(tokenizer)
        self.key = secrets.token_urlsafe(24)  # what every request must carry (Authorization: Bearer <key>)
        if host not in ("127.0.0.1", "localhost", "::1"):
            print(f"warning: the policy's endpoint listens on {host}, not on loopback: any host that reaches it and "
                  "holds the run's key can drive its sessions (preference.endpoint_host)", file=sys.stderr)
        self.sessions: dict[str, Session] = {}
        self.requests: queue.Queue[Request] = queue.Queue()
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer((host, port), handler(self))
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="policy-endpoint", daemon=True).start()

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def open(self) -> str:
        """A new session: its base URL (…/v1), for one episode's client."""
        key = uuid.uuid4().hex[:12]
        with self._lock:
            self.sessions[key] = Session(key)
        return f"{self.address}/s/{key}/v1"

    @staticmethod
    def session_id(url: str) -> str:
        return url.rstrip("/").split("/")[-2]

    def session(self, url: str) -> Session:
        return self.sessions[self.session_id(url)]

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # --- sampling: the caller's thread (the one that holds the policy) ---

    def serve(self, sample: Sampler, finished) -> None:
        """Sample the sessions' requests in batches until `finished()`: each batch every open session's request, or
        those in after `window_s`."""
        while not finished():
            try:
                first = self.requests.get(timeout=0.05)
            except queue.Empty:
                continue
            batch, deadline = [first], time.monotonic() + self.window_s
            while len(batch) < sum(s.open for s in self.sessions.values()) and time.monotonic() < deadline:
                try:
                    batch.append(self.requests.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            try:
                turns = sample([r.sequence for r in batch], [r.budget for r in batch])
            except Exception as e:  # every request of the batch is answered, then the rollout process fails
                for request in batch:
                    request.error = f"{type(e).__name__}: {e}"
                    request.done.set()
                raise
            for request, turn in zip(batch, turns, strict=True):
                request.turn = turn
                request.done.set()

    # --- a session's turns: the HTTP threads ---

    def budget_of(self, body: dict) -> int:
        """The request's max_completion_tokens (or max_tokens): a positive int, at most max_length; else Invalid."""
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is None:
            return self.max_length
        if isinstance(asked, bool) or not isinstance(asked, int) or not 0 < asked <= 1 << 20:
            raise Invalid(f"max_tokens must be a positive integer, not {asked!r}")
        return asked

    def check_chat(self, body: dict) -> None:
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise Invalid("messages must be a non-empty list of message objects")
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), (str, list, type(None))):
                raise Invalid(f"messages[{i}] needs a role (a string) and a content (a string, a list or null)")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise Invalid("tools must be a list of tool objects")
        self.budget_of(body)

    def check_completion(self, body: dict) -> None:
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab for i in prompt):
                raise Invalid(f"prompt's token ids must be integers in [0, {self.vocab})")
        elif not isinstance(prompt, (str, type(None))):
            raise Invalid("prompt must be a string or a list of token ids")
        self.budget_of(body)

    def chat(self, session: Session, body: dict) -> dict:
        self.check_chat(body)
        messages, tools = body.get("messages") or [], body.get("tools") or None
        if session.episode is None:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                                     return_dict=True)["input_ids"]
            session.episode, session.tools = Episode([dict(m) for m in messages], list(ids)), tools
        else:
            self._ready(session)
            known = session.episode.messages
            if len(messages) <= len(known) or any(not same(a, b) for a, b in zip(known, messages)):
                raise Refused("the conversation does not extend the session's: a session is one episode, its "
                              "requests each the conversation so far and what followed the policy's last turn",
                              "diverged")
            tail = [dict(m) for m in messages[len(known):]]
            # the end of the policy's last turn is the stop token it sampled (as in gptforge's own episodes: a
            # template may end turns with another token than the tokenizer's first stop id)
            eot = self.tokenizer.decode(session.episode.ids[-1:])
            self._between(session, between_turns(self.tokenizer, session.episode, tail, eot, session.tools))
            session.episode.messages += tail
        turn = self._turn(session, body)
        parsed = parse(self.tokenizer.decode(turn, skip_special_tokens=True), self.fmt).message()
        session.episode.messages.append(parsed)
        message = openai_message(parsed)
        reason = "length" if session.cut else "tool_calls" if message.get("tool_calls") else "stop"
        return self._answer(session, turn, {"index": 0, "message": message, "finish_reason": reason},
                            "chat.completion")

    def completion(self, session: Session, body: dict) -> dict:
        self.check_completion(body)
        prompt = body.get("prompt")
        ids = prompt if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt) else \
            self.tokenizer(prompt or "", add_special_tokens=False)["input_ids"]
        if session.episode is None:
            session.episode = Episode([], list(ids))
        else:
            self._ready(session)
            have = session.episode.prompt_ids + session.episode.ids
            if len(ids) <= len(have) or ids[:len(have)] != have:
                raise Refused("the prompt does not extend the session's tokens (the policy's turns as sampled)",
                              "diverged")
            self._between(session, ids[len(have):])
        turn = self._turn(session, body)
        return self._answer(session, turn, {"index": 0, "text": self.tokenizer.decode(turn, skip_special_tokens=True),
                                            "finish_reason": "length" if session.cut else "stop"}, "text_completion")

    def _ready(self, session: Session) -> None:
        if session.cut:
            raise Refused("the policy's last turn was cut by its token budget; the episode ends there", "truncated")
        if session.episode.turns >= self.max_turns:
            raise Refused(f"the episode has had its {self.max_turns} turns (preference.max_turns)", "max_turns")

    def _between(self, session: Session, between: list[int]) -> None:
        """The tokens after the policy's last turn, where they leave room for another turn (as gptforge's own
        episodes: the episode ends at its length budget without them)."""
        e = session.episode
        if len(e.prompt_ids) + len(e.ids) + len(between) >= self.max_length:
            raise Refused(f"what followed the policy's turn leaves no room for another under preference.max_length "
                          f"({self.max_length})", "max_length")
        e.ids += between
        e.mask += [0] * len(between)
        e.logprobs += [0.0] * len(between)

    def _turn(self, session: Session, body: dict) -> list[int]:
        e = session.episode
        sequence = e.prompt_ids + e.ids
        budget = min(self.budget_of(body), self.max_length - len(sequence))
        if budget <= 0:
            raise Refused(f"the conversation is {len(sequence)} tokens, with no room left under "
                          f"preference.max_length ({self.max_length})", "max_length")
        request = Request(sequence, budget)
        self.requests.put(request)
        if not request.done.wait(self.wait_s):
            raise Refused(f"no turn was sampled within {self.wait_s:g} s", "timeout")
        if request.error is not None:
            raise SamplerFailed(request.error)
        turn = request.turn
        e.ids += turn
        e.mask += [1] * len(turn)
        e.logprobs += getattr(turn, "logprobs", None) or [0.0] * len(turn)
        e.turns += 1
        session.cut = not (turn and turn[-1] in self.stop_ids)
        e.ended = "truncated" if session.cut else "answer"
        return list(turn)

    def _answer(self, session: Session, turn: list[int], choice: dict, kind: str) -> dict:
        e = session.episode
        logprobs = e.logprobs[len(e.logprobs) - len(turn):]
        choice["token_ids"] = turn
        choice["logprobs"] = {"content": [{"token": self.tokenizer.convert_ids_to_tokens(i), "logprob": lp,
                                           "bytes": None, "top_logprobs": []} for i, lp in zip(turn, logprobs)]}
        prompt = len(e.prompt_ids) + len(e.ids) - len(turn)
        return {"id": f"gptforge-{uuid.uuid4().hex[:16]}", "object": kind, "created": int(time.time()),
                "model": self.model, "choices": [choice], "prompt_token_ids": (e.prompt_ids + e.ids)[:prompt],
                "usage": {"prompt_tokens": prompt, "completion_tokens": len(turn), "total_tokens": prompt + len(turn)}}


def same(ours: dict, theirs: dict) -> bool:
    """Whether a message the harness sent back is the one the conversation holds (the policy's turns as the endpoint
    answered them: its content and calls, whatever ids and formatting the harness added)."""
    if ours.get("role") != theirs.get("role") or (ours.get("content") or "").strip() != \
            (theirs.get("content") or "").strip():
        return False
    calls = [(c["function"]["name"], arguments(c["function"].get("arguments"))) for c in ours.get("tool_calls") or []]
    back = [(c["function"]["name"], arguments(c["function"].get("arguments"))) for c in theirs.get("tool_calls") or []]
    return calls == back


def arguments(value):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def openai_message(message: dict) -> dict:
    """A parsed turn as OpenAI's assistant message: its calls with ids and their arguments as JSON text."""
    out = {"role": "assistant", "content": message.get("content") or ""}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": json.dumps(c["function"]["arguments"])}} for c in calls]
    return out


def handler(endpoint: Endpoint):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _session(self):
            match = PATH.match(self.path)
            session = endpoint.sessions.get(match["session"]) if match else None
            if session is None:
                self._send(404, {"error": {"message": f"no such session or path: {self.path}", "type": "not_found"}})
            return match, session

        def do_GET(self):
            if not self._authorized():
                return
            match, session = self._session()
            if session is not None:
                self._send(200, {"object": "list", "data": [{"id": endpoint.model, "object": "model",
                                                             "max_model_len": endpoint.max_length}]})

        def _authorized(self) -> bool:
            if secrets.compare_digest(self.headers.get("Authorization", ""), f"Bearer {endpoint.key}"):
                return True
            self._send(401, {"error": {"message": "a request must carry the run's key (Authorization: Bearer)",
                                       "type": "authentication_error"}})
            return False

        def do_POST(self):
            if not self._authorized():
                return
            match, session = self._session()
            if session is None:
                return
            try:
                length = int(self.headers.get("Content-Length", 0))
                if not 0 <= length <= 16 << 20:
                    raise Invalid("the body is over 16 MiB")
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except (ValueError, UnicodeDecodeError) as e:
                    raise Invalid(f"the body is not JSON ({e})") from None
                if not isinstance(body, dict):
                    raise Invalid(f"the body must be a JSON object, not {type(body).__name__}")
                if body.get("stream"):
                    raise Invalid("streaming is not served")
                if not session.open:
                    raise Refused("the session's episode is over", session.episode.ended if session.episode else "")
                answer = endpoint.chat(session, body) if match["kind"] == "chat/completions" else \
                    endpoint.completion(session, body)
            except Invalid as e:
                return self._send(400, {"error": {"message": str(e), "type": "invalid_request"}})
            except SamplerFailed as e:
                session.open = False
                return self._send(500, {"error": {"message": f"the sampler failed: {e}", "type": "server_error"}})
            except Refused as e:
                session.open = False
                if session.episode is not None:
                    session.episode.ended = e.ended
                code = 503 if e.ended == "timeout" else 400
                return self._send(code, {"error": {"message": str(e), "type": "invalid_request", "code": e.ended}})
            self._send(200, answer)

    return Handler
