"""An engine process's outgoing mail, coalesced, in the wire form.

Everything an engine sends while the host has not yet collected it waits here, and goes back in
one batch (one Ray call). A ``TokensProduced`` joins the one still waiting for its sequence when
only other sequences' tokens came after it, so a batch of streams costs the host one message per
sequence per collection rather than one per token; any other message closes every open run, so
no event moves across a terminal, a release or a reply. Order per destination is kept.
"""

from __future__ import annotations

from runtime.kernel.core import Address
from runtime.messages import Message, TokensProduced, encode

Wired = tuple[Address, bytes]  # a destination and a message in the wire form (messages.encode)


class Outbox:
    """Mail from one engine process to the host's actors (see module docstring)."""

    def __init__(self) -> None:
        self._items: list[tuple[Address, Message]] = []
        self._open: dict[tuple[Address, int], int] = {}  # (to, sequence) -> its tokens' index
        self.merged = 0  # token messages folded into an earlier one

    def __len__(self) -> int:
        return len(self._items)

    def put(self, to: Address, message: Message) -> None:
        if not isinstance(message, TokensProduced):
            self._open.clear()
            self._items.append((to, message))
            return
        key = (to, message.sequence_id)
        at = self._open.get(key)
        if at is None:
            self._open[key] = len(self._items)
            self._items.append((to, message))
            return
        earlier = self._items[at][1]
        assert isinstance(earlier, TokensProduced)
        self._items[at] = (to, merge_tokens(earlier, message))
        self.merged += 1

    def take(self) -> list[Wired]:
        """Everything waiting, encoded, oldest first; the outbox is empty afterwards."""
        items = [(to, encode(message)) for to, message in self._items]
        self._items.clear()
        self._open.clear()
        return items


def merge_tokens(first: TokensProduced, then: TokensProduced) -> TokensProduced:
    """One event saying what ``first`` and ``then`` (of the same sequence) said, in order."""
    return TokensProduced(
        sequence_id=first.sequence_id,
        epoch=first.epoch,
        token_ids=first.token_ids + then.token_ids,
        text=first.text + then.text,
        logprobs=first.logprobs + then.logprobs,
    )
