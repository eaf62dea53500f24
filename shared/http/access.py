"""Who may call the service: loopback without a token, any other address only with a bearer token."""

from __future__ import annotations

import ipaddress
import secrets

from poolbench.http.service_errors import ServiceConfigError
from poolbench.http.settings import ServiceSettings

TOKEN_ENV = "POOLBENCH_TOKEN"


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost: nobody else on the network can connect there."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, token: str | None) -> None:
    """Refuse, in one line, to listen beyond loopback with no token: the models would be open to the network."""
    if token is None and not is_loopback_host(host):
        raise ServiceConfigError(f"refusing to serve on {host} without a bearer token: pass --token or set "
                                 f"{TOKEN_ENV} (or listen on 127.0.0.1)")


def with_token(settings: ServiceSettings, token: str | None) -> ServiceSettings:
    """The settings with this bearer token (at least 16 characters), or one line saying why not."""
    if token is not None and len(token) < 16:
        raise ServiceConfigError(f"the bearer token has {len(token)} characters; use at least 16 "
                                 "(e.g. python -c 'import secrets; print(secrets.token_hex(16))')")
    return settings.model_copy(update={"token": token})


def bearer_ok(header: str | None, token: str) -> bool:
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), token.encode())
