"""Host submissions that wait for the router's mailbox (backpressure) and are cancelled there."""

from __future__ import annotations

import anyio
import pytest

from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.host.streams import HOST
from runtime.kernel.core import ROUTER
from runtime.messages import Cancel, Finished, ModelSpec

pytestmark = pytest.mark.anyio


async def test_a_request_cancelled_while_waiting_for_mailbox_space_is_forgotten() -> None:
    config = RuntimeConfig(kv_budget_bytes=1 << 20, router_mailbox_capacity=1)
    async with Runtime(config) as rt:
        await rt.load_model(ModelSpec(name="m", backend="simulated"))
        # The router takes the first at once; the second fills its one-message mailbox.
        system = rt._require_system()
        system.tell(ROUTER, Cancel(request_id="filler-1", incarnation=0), sender=HOST)
        system.tell(ROUTER, Cancel(request_id="filler-2", incarnation=0), sender=HOST)
        with anyio.CancelScope() as scope:
            scope.cancel()  # e.g. an HTTP client that went away while its request waited
            async with rt.generate("m", "hi", request_id="r", max_tokens=2):
                pytest.fail("the submission should have been cancelled while it waited")
        assert not await rt.cancel("r")  # not live: it never reached the router
        again = await rt.complete("m", "hi", request_id="r", max_tokens=2)
        assert isinstance(again.terminal, Finished)
        assert rt.unrouted_events.total() == 0
