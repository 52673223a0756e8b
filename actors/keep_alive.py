"""Keep-alive bookkeeping of the router's models: which epochs run requests, and idle spells.

A model epoch is *idle* while it is ready and no request of it is live. Each idle spell gets a
fresh ticket (never reused) and, when the model has a keep-alive, one ``IdleCheck`` timer naming
that ticket. A request accepted, or the epoch leaving the table, ends the spell: the timer still
fires, finds a ticket that is not the current one and is dropped (counted by the router). So no
timer is ever cancelled, and none can unload a model that served a request since it was armed.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from runtime.kernel.core import Context
from runtime.messages import IdleCheck


@dataclass(frozen=True)
class _Spell:
    ticket: int
    since: float


class KeepAlive:
    """Live requests per epoch and the current idle spell of each idle epoch."""

    def __init__(self) -> None:
        self._live: Counter[int] = Counter()
        self._spells: dict[int, _Spell] = {}
        self._next_ticket = 1

    def live(self, epoch: int) -> int:
        """How many requests of ``epoch`` the router holds live."""
        return self._live[epoch]

    def started(self, epoch: int) -> None:
        """A request of ``epoch`` was accepted: the epoch is busy (its spell, if any, is over)."""
        self._live[epoch] += 1
        self._spells.pop(epoch, None)

    def ended(self, epoch: int) -> bool:
        """A request of ``epoch`` ended; whether it was the last one live."""
        self._live[epoch] -= 1
        if self._live[epoch] > 0:
            return False
        del self._live[epoch]
        return True

    def went_idle(self, model: str, epoch: int, keep_alive_s: float | None, ctx: Context) -> None:
        """Begin an idle spell of ``epoch`` and, with a keep-alive, arm its one timer."""
        spell = _Spell(self._next_ticket, ctx.now())
        self._next_ticket += 1
        self._spells[epoch] = spell
        if keep_alive_s is not None:
            ctx.send_later(
                keep_alive_s, IdleCheck(model=model, epoch=epoch, idle_ticket=spell.ticket)
            )

    def is_due(self, check: IdleCheck) -> bool:
        """Whether ``check`` fired in the spell it was armed for (nothing ran since)."""
        spell = self._spells.get(check.epoch)
        return (
            spell is not None and spell.ticket == check.idle_ticket and not self._live[check.epoch]
        )

    def forget(self, epoch: int) -> None:
        """``epoch`` left the table (unloading, restarting, failed): no spell of it goes on."""
        self._spells.pop(epoch, None)

    def expires_in(self, epoch: int, keep_alive_s: float | None, now: float) -> float | None:
        """Seconds until the keep-alive of idle ``epoch`` runs out (None: busy or kept forever)."""
        spell = self._spells.get(epoch)
        if spell is None or keep_alive_s is None or not math.isfinite(keep_alive_s):
            return None
        return max(spell.since + keep_alive_s - now, 0.0)
