"""The KV budget keeper: the one place that knows how many bytes of KV exist and who holds them.

Every sequence, cached prefix entry and decode batch's left padding holds a reservation here,
named by a ``Holder`` (model, epoch, kind, id). One owner for the count keeps the budget a plain
sum that can be checked after every step (``free + reserved == budget``), where accounting spread
over the engines would race. The keeper never touches MLX: it only counts and answers, so it runs
unchanged in the simulator. The queue is strict FIFO (a small request never jumps a large one),
and waiting asks the prefix cache to evict the queue's shortfall.

Each message's policy and the invariants: docs/protocols.md, "KV reservation".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import assert_never

import msgspec

from actors.kv_ledgers import HOST_NODE, Ledger, Ledgers
from actors.kv_queue import QueuedReservation, Waiting, WaitingQueue
from actors.kv_timers import QueueTimers
from runtime.errors import InvalidRequest, KVBudgetExhausted, KVRequestTooLarge, MlxRuntimeError
from runtime.kernel.core import PREFIX_CACHE, Address, Context
from runtime.kernel.stats import Counters
from runtime.messages import (
    EnginePlaced,
    EpochReleased,
    Evict,
    GetStats,
    Holder,
    KVInbox,
    Lookup,
    Message,
    Release,
    ReleaseEpoch,
    ReservationExpired,
    ReservationPressure,
    ReservationRefused,
    Reserve,
    Reserved,
    Stats,
    Transfer,
)

log = logging.getLogger("mlx_actor_runtime.kv")

# Always reported, so a dashboard sees a zero rather than a missing key.
# fmt: off
_COUNTER_NAMES = (
    "granted", "queued", "evict_requests", "refused_invalid", "refused_too_large",
    "refused_timeout", "refused_no_wait", "released", "released_unknown", "transfers",
    "transfer_short", "transfer_invalid", "transfer_unknown_source", "dropped_waiting",
    "stale_timer", "stale_epoch", "unexpected_message", "evict_pinned_requests",
    "released_partial", "release_short", "release_invalid", "placements", "transfer_across_nodes",
    "lookups_sent_on",
)
# fmt: on


def _describe(holder: Holder) -> str:
    return f"{holder.kind} {holder.id} of {holder.model}#{holder.epoch}"


class KVBudgetCore:
    """Grants, queues and refuses KV reservations against a fixed byte budget (see module doc)."""

    def __init__(
        self,
        budget_bytes: int,
        default_timeout_s: float = 30.0,
        prefix_cache: Address = PREFIX_CACHE,
        *,
        node_budgets: Mapping[str, int] | None = None,
        node_default_bytes: int | None = None,
    ) -> None:
        """``budget_bytes``: the host's budget (its in-process engines'); ``node_budgets``: a Ray
        node's, by node id or IP address; other nodes have ``node_default_bytes`` (None: the
        host's)."""
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if not (default_timeout_s >= 0 and math.isfinite(default_timeout_s)):
            raise ValueError(f"default_timeout_s must be finite and >= 0, got {default_timeout_s}")
        node_default = budget_bytes if node_default_bytes is None else node_default_bytes
        if node_default < 0 or any(b < 0 for b in (node_budgets or {}).values()):
            raise ValueError("node budgets must be >= 0")
        self._ledgers = Ledgers(budget_bytes, node_budgets or {}, node_default)
        self._default_timeout_s = default_timeout_s
        self._prefix_cache = prefix_cache
        self._holdings: dict[Holder, int] = {}
        self._waiting = WaitingQueue()  # FIFO per node
        self._retired_epochs: dict[str, int] = {}
        self._timers = QueueTimers()
        self.counters = Counters(_COUNTER_NAMES)

    # ------------------------------------------------------------------ read-only views

    @property
    def budget_bytes(self) -> int:
        """The whole budget, in bytes (summed over the nodes' ledgers)."""
        return sum(ledger.budget for ledger in self._ledgers)

    @property
    def reserved_bytes(self) -> int:
        """Bytes currently granted to holders (on every node)."""
        return sum(ledger.reserved for ledger in self._ledgers)

    @property
    def free_bytes(self) -> int:
        """Bytes not granted to anyone (``budget_bytes - reserved_bytes``)."""
        return self.budget_bytes - self.reserved_bytes

    def nodes(self) -> dict[str, tuple[int, int]]:
        """Each node's (budget, reserved bytes); ``"host"`` is the host's own process."""
        return {ledger.node: (ledger.budget, ledger.reserved) for ledger in self._ledgers}

    def node_of(self, holder: Holder) -> str | None:
        """The node ``holder`` holds bytes on (None: it holds nothing)."""
        return self._ledgers.holds(holder)

    def holding(self, holder: Holder) -> int:
        """Bytes granted to ``holder`` (0 if it holds nothing)."""
        return self._holdings.get(holder, 0)

    def holdings(self) -> Mapping[Holder, int]:
        """A copy of each holder's bytes (a holder stays listed, even at 0, until released)."""
        return dict(self._holdings)

    def queued(self) -> tuple[QueuedReservation, ...]:
        """Waiting reservations, head first."""
        return self._waiting.snapshot()

    # ------------------------------------------------------------------ actor interface

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        """Apply one message; never raises on bad input (it is refused or counted), and one
        outside ``KVInbox`` is counted ``unexpected_message``."""
        if isinstance(message, KVInbox):
            self._receive(message, sender, ctx)
        else:
            self._count_dropped("unexpected_message", ctx)

    def _receive(self, message: KVInbox, sender: Address, ctx: Context) -> None:
        match message:
            case Reserve(holder=holder) if self._is_retired(holder):
                self._count_dropped("stale_epoch", ctx)  # its epoch's teardown has released all
            case Reserve():
                self._reserve(message, sender, ctx)
            case Release(holder=holder, nbytes=nbytes):
                if nbytes is None:
                    self._release(holder, ctx)
                else:
                    self._release_part(holder, nbytes, ctx)
            case Transfer():
                self._transfer(message, ctx)
            case ReleaseEpoch(model=model, epoch=epoch):
                self._release_epoch(model, epoch, ctx)
                ctx.send(sender, EpochReleased(model=model, epoch=epoch))
            case EnginePlaced(model=model, epoch=epoch, node=node, node_ip=node_ip):
                self._ledgers.place(model, epoch, node, node_ip)
                self.counters.inc("placements")
            case ReservationExpired(holder=holder, ticket=ticket) if not self._still_waits(
                holder, ticket
            ):
                self._count_dropped("stale_timer", ctx)  # granted or dropped before its deadline
                self._deadline_passed(ticket, ctx)
            case ReservationExpired(holder=holder, ticket=ticket):
                self._expire(holder, ticket, ctx)
                self._deadline_passed(ticket, ctx)
            case ReservationPressure(ticket=ticket):
                self._halfway_passed(ticket, ctx)
            case GetStats():
                ctx.send(sender, self.statistics())
            case _:
                assert_never(message)

    def on_start(self, ctx: Context) -> None:
        """Nothing to set up: the budget is fixed at construction."""

    def on_stop(self, ctx: Context) -> None:
        """Nothing to release: the keeper holds only bookkeeping, and its holders stop with it."""

    # ------------------------------------------------------------------ policy

    def _reserve(self, request: Reserve, sender: Address, ctx: Context) -> None:
        holder, nbytes = request.holder, request.nbytes
        timeout_s = self._default_timeout_s if request.timeout_s is None else request.timeout_s
        if nbytes < 0 or not (timeout_s >= 0 and math.isfinite(timeout_s)):
            self.counters.inc("refused_invalid")
            text = (
                f"nbytes={nbytes} and timeout_s={timeout_s} must be finite and >= 0 (caller bug)."
            )
            self._refuse(sender, holder, nbytes, InvalidRequest, text, ctx)
            return
        ledger = self._ledgers.for_holder(holder)
        if nbytes > ledger.budget:
            self.counters.inc("refused_too_large")
            where = "" if ledger.node == HOST_NODE else f" of its node {ledger.node[:12]}"
            text = (
                f"the request needs {nbytes} bytes of KV cache, more than the whole KV budget"
                f"{where} ({ledger.budget} bytes); shorten the prompt or lower max_tokens (or "
                "give the runtime a larger kv_budget_bytes, or the node a larger "
                "ClusterConfig.node_kv_budget_bytes)."
            )
            self._refuse(sender, holder, nbytes, KVRequestTooLarge, text, ctx)
            return
        if not self._waiting.waits_on(ledger.node) and nbytes <= ledger.free:
            self._grant(holder, nbytes, ledger, sender, ctx, request.then_lookup)
            return
        if timeout_s == 0:  # "only if it fits now": never queue, never evict for it
            self.counters.inc("refused_no_wait")
            text = f"{nbytes} bytes of KV cache were asked for only if free now; they are not."
            self._refuse(sender, holder, nbytes, KVBudgetExhausted, text, ctx)
            return
        node, then_lookup = ledger.node, request.then_lookup
        self._waiting.add(holder, nbytes, ctx.now(), timeout_s, sender, node, then_lookup)
        self.counters.inc("queued")
        self.counters.inc("evict_requests")
        # Ask for the node's whole queue's shortfall: everything ahead is served before this one.
        ctx.send(self._prefix_cache, self._evict(ledger))
        # Half-way to the deadline, pinned entries (session instructions) may be evicted too:
        # they never make a reservation wait out its whole deadline.
        self._timers.arm(self._waiting.values(), ctx)

    def _release(self, holder: Holder, ctx: Context) -> None:
        dropped = self._drop_waiting(lambda w: w.holder == holder, ctx)
        if holder in self._holdings:
            self._release_holding(holder)
        elif not dropped:
            self._count_dropped("released_unknown", ctx)
        self._grant_waiting(ctx)
        self._ask_eviction_again(ctx)

    def _release_part(self, holder: Holder, nbytes: int, ctx: Context) -> None:
        held = self._holdings.get(holder)
        if held is None:
            self._count_dropped("released_unknown", ctx)
            return
        if nbytes < 0:
            self._count_dropped("release_invalid", ctx)
            return
        freed = min(nbytes, held)
        if freed < nbytes:
            self._count_dropped("release_short", ctx)
        self._holdings[holder] = held - freed
        self._ledgers.for_holder(holder).reserved -= freed
        self.counters.inc("released_partial")
        self._grant_waiting(ctx)
        self._ask_eviction_again(ctx)

    def _transfer(self, transfer: Transfer, ctx: Context) -> None:
        source, target = transfer.source, transfer.target
        if transfer.nbytes < 0:
            self._count_dropped("transfer_invalid", ctx)
            return
        if source not in self._holdings:
            self._count_dropped("transfer_unknown_source", ctx)
            return
        if self._is_retired(target):
            # The target's epoch is gone, so nothing would ever release it: keep the bytes put.
            self._count_dropped("stale_epoch", ctx)
            return
        ledger = self._ledgers.for_holder(source)
        there = self._ledgers.holds(target)
        if there is not None and there != ledger.node:
            # Bytes live in one node's memory: a holder cannot take them from another node.
            self._count_dropped("transfer_across_nodes", ctx)
            return
        held = self._holdings[source]
        moved = min(transfer.nbytes, held)
        if moved < transfer.nbytes:
            self._count_dropped("transfer_short", ctx)
        self._holdings[source] = held - moved
        self._holdings[target] = self._holdings.get(target, 0) + moved
        self._ledgers.hold(target, ledger)
        self.counters.inc("transfers")

    def _release_epoch(self, model: str, epoch: int, ctx: Context) -> None:
        self._retired_epochs[model] = max(epoch, self._retired_epochs.get(model, epoch))
        self._drop_waiting(lambda w: w.holder.model == model and w.holder.epoch == epoch, ctx)
        for holder in [h for h in self._holdings if h.model == model and h.epoch == epoch]:
            self._release_holding(holder)
        self._ledgers.forget_epoch(model, epoch)
        self._grant_waiting(ctx)
        self._ask_eviction_again(ctx)

    def _still_waits(self, holder: Holder, ticket: int) -> bool:
        waiting = self._waiting.get(ticket)
        return waiting is not None and waiting.holder == holder

    def _deadline_passed(self, ticket: int, ctx: Context) -> None:
        """A deadline timer fired: every reservation due by now is refused, earliest first (only
        the earliest had a timer; one that an earlier refusal let in was granted instead), and
        the next deadline gets one."""
        self._timers.expiry_fired(ticket)
        for waiting in self._waiting.due(ctx.now()):
            # An earlier one's expiry may have let this one in (granted): it no longer waits.
            if waiting.ticket in self._waiting:
                self._expire(waiting.holder, waiting.ticket, ctx)
        self._timers.arm(self._waiting.values(), ctx)

    def _halfway_passed(self, ticket: int, ctx: Context) -> None:
        """A half-way timer fired: if a reservation still waits past its half-way point, pinned
        entries may go too (one ``Evict`` asks for the whole queue's shortfall)."""
        self._timers.pressure_fired(ticket)
        now = ctx.now()
        pressed = self._waiting.pressed_nodes(now)
        if (waiting := self._waiting.get(ticket)) is not None:
            pressed.add(waiting.node)
        for node in sorted(pressed):
            self.counters.inc("evict_pinned_requests")
            ctx.send(self._prefix_cache, self._evict(self._ledgers[node], include_pinned=True))
        self._timers.arm(self._waiting.values(), ctx)

    def _expire(self, holder: Holder, ticket: int, ctx: Context) -> None:
        waiting = self._waiting.pop(ticket)
        self.counters.inc("refused_timeout")
        # Who else holds or waits is other clients' business: the log has it, the message not.
        ledger = self._ledgers[waiting.node]
        log.info("%s waited %gs for %d bytes of KV (%d of %d free on %s, %d still waiting)",
                 _describe(holder), waiting.timeout_s, waiting.nbytes, ledger.free, ledger.budget,
                 ledger.node, len(self._waiting))  # fmt: skip
        text = (
            f"the request waited {waiting.timeout_s:g}s for {waiting.nbytes} bytes of KV cache "
            "and the server is still busy; retry later, or lower max_tokens."
        )
        self._refuse(waiting.requester, holder, waiting.nbytes, KVBudgetExhausted, text, ctx)
        self._grant_waiting(ctx)
        self._ask_eviction_again(ctx)

    # ------------------------------------------------------------------ helpers

    def _grant(
        self,
        holder: Holder,
        nbytes: int,
        ledger: Ledger,
        requester: Address,
        ctx: Context,
        then_lookup: Lookup | None = None,
    ) -> None:
        self._holdings[holder] = self._holdings.get(holder, 0) + nbytes
        ledger.reserved += nbytes
        self._ledgers.hold(holder, ledger)
        self.counters.inc("granted")
        ctx.send(requester, Reserved(holder=holder, nbytes=nbytes))
        if then_lookup is not None:  # after Reserved: the requester hears the grant first
            self.counters.inc("lookups_sent_on")
            lookup = msgspec.structs.replace(then_lookup, reply_to=requester)
            ctx.send(self._prefix_cache, lookup)

    def _evict(self, ledger: Ledger, include_pinned: bool = False) -> Evict:
        """Ask for ``ledger``'s queue's shortfall, from the entries holding bytes on its node."""
        shortfall = self._waiting.queued_bytes(ledger.node) - ledger.free
        epochs = self._ledgers.epochs_on(ledger.node)
        return Evict(nbytes=shortfall, include_pinned=include_pinned, epochs=epochs)

    def _ask_eviction_again(self, ctx: Context) -> None:
        """Entries cached since the last ask (a finished request's state) may be evictable now."""
        for node in self._waiting.nodes():
            self.counters.inc("evict_requests")
            ctx.send(self._prefix_cache, self._evict(self._ledgers[node]))

    def _grant_waiting(self, ctx: Context) -> None:
        """Each node's queue, from its head, as long as its reservations fit its free bytes."""
        for head in self._waiting.fitting_heads(lambda node: self._ledgers[node].free):
            ledger = self._ledgers[head.node]
            self._grant(head.holder, head.nbytes, ledger, head.requester, ctx, head.then_lookup)

    def _release_holding(self, holder: Holder) -> None:
        self._ledgers.forget(holder).reserved -= self._holdings.pop(holder)
        self.counters.inc("released")

    def _drop_waiting(self, doomed: Callable[[Waiting], bool], ctx: Context) -> int:
        dropped = self._waiting.drop(doomed)
        for _ in range(dropped):
            self._count_dropped("dropped_waiting", ctx)
        return dropped

    def _refuse(
        self,
        requester: Address,
        holder: Holder,
        nbytes: int,
        error: type[MlxRuntimeError],
        text: str,
        ctx: Context,
    ) -> None:
        refusal = ReservationRefused(
            holder=holder, nbytes=nbytes, code=error.code, message=text, retryable=error.retryable
        )
        ctx.send(requester, refusal)

    def _is_retired(self, holder: Holder) -> bool:
        retired = self._retired_epochs.get(holder.model)
        return retired is not None and holder.epoch <= retired

    def _count_dropped(self, reason: str, ctx: Context) -> None:
        self.counters.inc(reason)
        ctx.count_dead_letter(reason)

    def statistics(self) -> Stats:
        """The keeper's counters and gauges now (an immutable snapshot)."""
        gauges = {
            "budget": self.budget_bytes,
            "reserved": self.reserved_bytes,
            "free": self.free_bytes,
            "queued": len(self._waiting),
            "queued_bytes": self._waiting.queued_bytes(),
            "holders": len(self._holdings),
        }
        if self._ledgers.spread:  # per node, once an engine runs off the host
            for ledger in self._ledgers:
                gauges[f"node_budget:{ledger.node}"] = ledger.budget
                gauges[f"node_reserved:{ledger.node}"] = ledger.reserved
                gauges[f"node_queued:{ledger.node}"] = self._waiting.count_on(ledger.node)
        return Stats(actor="kv", counters=self.counters.snapshot(), gauges=gauges)
