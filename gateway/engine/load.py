"""The engine's live state at the gateway, for the SLO admission (gateway/pipeline/admission.py).

`LoadWatcher` keeps one engine's latest `common.wire.EngineLoad`, never more than one iteration
old while the engine runs (it long-polls the control endpoint's `CONTROL_LOAD_PATH`), and the RT
work the gateway sent after that state was taken (`backlog`), which the engine's report cannot
show yet.

INTERFACE STUB — the long-poll loop is being built; `latest` stays None until it is.
"""

from __future__ import annotations

import collections
import time

from backend.policy.feasibility import Backlog
from common.wire import EngineLoad


class LoadWatcher:
    """One engine's live state as the gateway knows it."""

    def __init__(self, engine_name: str) -> None:
        self.engine_name = engine_name
        self.latest: EngineLoad | None = None
        """The newest state the engine reported; None before its first (or when it is down)."""
        self._sent: collections.deque[tuple[float, int]] = collections.deque()

    def sent(self, prompt_tokens: int, now_unix_s: float | None = None) -> None:
        """An RT request with *prompt_tokens* was just sent to the engine."""
        self._sent.append((time.time() if now_unix_s is None else now_unix_s, prompt_tokens))

    def backlog(self) -> Backlog:
        """RT requests sent after `latest` was taken (all of them before the first report)."""
        since = self.latest.at_unix_s if self.latest is not None else float("-inf")
        while self._sent and self._sent[0][0] <= since:
            self._sent.popleft()
        return Backlog(len(self._sent), sum(n for _, n in self._sent))
