"""Commands the router passes on to another actor, and the replies it matches back to the asker.

``ResetPrefixes`` goes to the prefix manager once per serving load of the model (each replica of a
model with replicas), and the asker hears one ``PrefixesReset`` once the last one answered: the
prefix manager answers in order, so a FIFO of waits matches each reply. ``EndSession`` goes to the
load holding the session (its replica), which answers ``SessionEnded``; one engine answers its own
asks in order, so a FIFO per (engine, session) matches it. A reply nobody waits for is dropped and
counted. See docs/protocols.md, "Prefix cache" and "Replicas and routing".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import msgspec

from actors.model_lifecycle import ModelLifecycle
from actors.model_record import not_loaded
from actors.replicas import Replicas
from runtime.kernel.core import PREFIX_CACHE, Address, Context
from runtime.kernel.stats import Counters
from runtime.messages import EndSession, Message, PrefixesReset, ResetPrefixes, SessionEnded


@dataclass
class ResetWait:
    """A ``ResetPrefixes`` asker waiting for ``left`` replies (one per load reset)."""

    asker: Address
    model: str
    left: int
    dropped: int = 0

    def answered(self, reply: PrefixesReset) -> PrefixesReset | None:
        """Count one reply; the asker's answer once the last one is in."""
        self.left -= 1
        self.dropped += reply.dropped
        return PrefixesReset(model=self.model, dropped=self.dropped) if not self.left else None


class CommandReplies:
    """The router's passed-on commands and their waiting askers (see module docstring)."""

    def __init__(self, models: ModelLifecycle, replicas: Replicas, counters: Counters) -> None:
        self._models = models
        self._replicas = replicas
        self._counters = counters
        self._reset_waiters: deque[ResetWait] = deque()
        self._session_waiters: dict[tuple[Address, str], deque[Address]] = {}

    def reset_prefixes(self, message: ResetPrefixes, asker: Address, ctx: Context) -> None:
        # A model with replicas resets each serving one (a restarting one holds nothing).
        model = message.model
        loads = [n for n in self._replicas.names(model) or (model,) if self._models.ready(n)]
        if not loads:
            ctx.send(asker, not_loaded(model))
            return
        wait = ResetWait(asker, model, len(loads))
        for name in loads:
            self._reset_waiters.append(wait)
            one = msgspec.structs.replace(message, model=name)
            ctx.send(PREFIX_CACHE, one)
            serving = self._models.ready(name)
            if serving is not None:  # its disk tier forgets the scope too, before new work
                ctx.send(serving.address, one)

    def prefixes_reset(self, reply: PrefixesReset, sender: Address, ctx: Context) -> None:
        if sender != PREFIX_CACHE or not self._reset_waiters:
            self._unmatched(reply, ctx)
            return
        wait = self._reset_waiters.popleft()
        if (done := wait.answered(reply)) is not None:
            ctx.send(wait.asker, done)

    def end_session(self, message: EndSession, asker: Address, ctx: Context) -> None:
        ready = self._models.ready(self._replicas.holder(message.model, message.session))
        if ready is None:
            ctx.send(asker, not_loaded(message.model))
            return
        self._session_waiters.setdefault((ready.address, message.session), deque()).append(asker)
        ctx.send(ready.address, message)

    def session_ended(self, reply: SessionEnded, engine: Address, ctx: Context) -> None:
        key = (engine, reply.session)
        waiters = self._session_waiters.get(key)
        if not waiters:
            self._unmatched(reply, ctx)
            return
        asker = waiters.popleft()
        if not waiters:
            del self._session_waiters[key]
        ctx.send(asker, reply)

    def _unmatched(self, reply: Message, ctx: Context) -> None:
        """A reply nobody is waiting for (a bug elsewhere, or a stray sender): drop and count it."""
        self._counters.inc("unmatched_replies")
        ctx.count_dead_letter(f"unmatched_reply:{type(reply).__name__}")
