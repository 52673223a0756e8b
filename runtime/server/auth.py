"""API keys and the tenants they stand for: who may use the server, and whose cache is whose.

A server given keys (``ServerConfig.api_keys``) answers only requests that present one
(``Authorization: Bearer`` or ``x-api-key``). Keys are held only as SHA-256 digests; the presented
key's digest is compared with every one by ``hmac.compare_digest``, with no early exit, so neither
the answer nor its timing says which key nearly matched. Each key is a tenant whose id is a short
hash of the key, all that logs, namespaces and sessions carry. ``scoped`` moves a request into its
tenant's prefix-cache namespace and session space, so one key's cached prompts can neither serve nor
be timed by another's. See docs/http.md, "Security".
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
from starlette.requests import Request

from runtime.errors import InvalidConfig
from runtime.messages import Request as RuntimeRequest

TENANT_SCOPE_KEY = "mlxrt.tenant"  # where the gate leaves the request's Tenant in its ASGI scope
_DIGEST_DOMAIN = b"mlxrt-api-key\x00"  # a key's digest here is no plain SHA-256 found elsewhere
_TENANT_ID_HEX = 16  # 64 bits: unique among any server's keys, too short to stand for the digest


@dataclass(frozen=True)
class Tenant:
    """The holder of one API key. ``id`` names it in namespaces, sessions and logs."""

    id: str

    def namespace(self, salted: str) -> str:
        """The prefix-cache namespace of this tenant's request whose own namespace (its
        ``cache_salt``, or ``"default"``) is ``salted``."""
        return f"key-{self.id}/{salted}"

    def session(self, session: str) -> str:
        """This tenant's session ``session``: a newcomer supersedes or adopts only its own."""
        return f"key-{self.id}/{session}"


class ApiKeys:
    """The keys a server accepts, kept as digests only (so no repr or dump shows a key).

    Raises ``InvalidConfig`` for no keys, or a key that could not travel in a header: empty, or
    other than printable ASCII without spaces (the message gives its position, never the key).
    """

    def __init__(self, keys: Iterable[str], *, source: str = "api_keys") -> None:
        digests: list[bytes] = []
        for position, key in enumerate(keys, 1):
            check_key(key, f"{source} key {position}")
            digests.append(_digest(key))
        if not digests:
            raise InvalidConfig(
                f"{source} holds no keys; give at least one key, or none at all (api_keys=None) "
                "for a server that answers without one"
            )
        self._digests = tuple(dict.fromkeys(digests))  # a key given twice is one tenant

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys(<{len(self)} key{'' if len(self) == 1 else 's'}>)"

    def tenant_of(self, presented: str | None) -> Tenant | None:
        """The tenant whose key ``presented`` is; None for a missing or unknown key.

        Every digest is compared, whatever matched: the time taken does not depend on which.
        """
        digest = _digest(presented or "")  # "" is never a key: compared all the same
        matched: bytes | None = None
        for known in self._digests:
            if hmac.compare_digest(digest, known):
                matched = known
        return None if matched is None else Tenant(matched.hex()[:_TENANT_ID_HEX])


def check_key(key: str, where: str) -> None:
    """Raises ``InvalidConfig`` unless ``key`` can be sent as a header value as it is."""
    if not key or not all("!" <= char <= "~" for char in key):
        raise InvalidConfig(
            f"{where} is not a usable API key: a key is one or more printable ASCII characters "
            "without spaces (make one with: python -c 'import secrets; print(secrets.token_hex())')"
        )


def read_key_file(path: str | Path) -> list[str]:
    """The keys in ``path``: one a line; blank lines and lines starting with ``#`` are skipped,
    spaces around a key are not part of it. Raises ``InvalidConfig`` for a file that cannot be
    read, a line that is not a key (naming its number) or a file with no keys."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or "not UTF-8 text"
        raise InvalidConfig(f"cannot read the API key file {path}: {reason}") from None
    keys: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if key and not key.startswith("#"):
            check_key(key, f"line {number} of the API key file {path}")
            keys.append(key)
    if not keys:
        raise InvalidConfig(
            f"the API key file {path} holds no keys; write one key per line ('#' starts a comment)"
        )
    return keys


def presented_key(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The key a request presents: ``Authorization: Bearer <key>``, else ``x-api-key``."""
    bearer = api_key = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer":
                bearer = token.strip()
        elif name == b"x-api-key":
            api_key = value.decode("latin-1").strip()
    return bearer if bearer is not None else api_key


def tenant_of(request: Request) -> Tenant | None:
    """The tenant the gate found for ``request``; None on a server without keys."""
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    return tenant if isinstance(tenant, Tenant) else None


def scoped(request: Request, asked: RuntimeRequest) -> RuntimeRequest:
    """``asked`` in its tenant's namespace and session space (as it is without keys)."""
    tenant = tenant_of(request)
    if tenant is None:
        return asked
    session = None if asked.session is None else tenant.session(asked.session)
    return msgspec.structs.replace(
        asked, namespace=tenant.namespace(asked.namespace), session=session
    )


def _digest(key: str) -> bytes:
    return hashlib.sha256(_DIGEST_DOMAIN + key.encode("utf-8")).digest()
