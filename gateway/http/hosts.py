"""The ``Host`` allow-list, against DNS rebinding.

A web page on ``evil.example`` can make its own name resolve to ``127.0.0.1`` after the
page has loaded; the browser then sends the page's requests to the gateway as
same-origin requests, which CORS does not stop, but with ``Host: evil.example``. A
request whose Host names no name of this server is refused with 421.

Accepted without configuration, since no attacker can make a browser send them from a
page of their own:

* any IP address (``127.0.0.1``, ``[::1]``, ``192.168.1.5``): a page whose Host is an
  address was served by that address, i.e. by the gateway itself;
* ``localhost`` and its subdomains (``*.localhost``), which browsers resolve to the
  loopback interface without asking DNS;
* ``host.docker.internal``, the name a container on this machine (the Prometheus of
  ``deploy/``) gives it; ``.internal`` names cannot be registered;
* the ``--host`` the server is bound to, when it is a name;
* with a wildcard ``--host`` (``0.0.0.0``, ``::``), which serves the whole network, also
  the machine's own names: :func:`socket.gethostname`, :func:`socket.getfqdn` and, for a
  one-label host name, ``NAME.local`` (mDNS). These are resolved by the local network or
  its administrator, not by a public page's DNS; other names need ``--allowed-hosts``.

``--allowed-hosts`` adds names; ``*`` accepts any Host (e.g. behind a reverse proxy that
checks it). Ports are ignored. A request without a Host header (HTTP/1.0), or with an
empty one, is accepted: browsers always send the Host of the URL, so such a request does
not come from a web page.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from typing import Iterable, Optional

from gateway.http.errors import APIError

log = logging.getLogger("mlx_gateway.app")

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1", "host.docker.internal")
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "[::]"})
_NAME = re.compile(r"^[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*$")


class HostNotAllowed(APIError):
    """421: the request's Host header names no name of this server (an invalid-request
    error, code ``host_not_allowed``)."""

    def __init__(self, host: str):
        shown = host[:100].encode("ascii", "backslashreplace").decode()
        super().__init__(421, f"the Host '{shown}' is not allowed on this server (DNS rebinding protection); "
                         f"start the server with --allowed-hosts {shown or '<name>'} to accept it",
                         code="host_not_allowed")


def host_name(value: str) -> Optional[str]:
    """The name in a Host header value or an allow-list entry: lowercased, without the
    port, the brackets of an IPv6 address or a final dot; None when ``value`` is no
    host name or address (e.g. ``a b``, ``x:y:z``, ``[::1``)."""
    v = value.strip().lower()
    if v.startswith("["):
        name, sep, rest = v[1:].partition("]")
        if not sep or (rest and not re.fullmatch(r":\d*", rest)):
            return None
        return name if _address(name) else None
    if v.count(":") > 1:  # a bare IPv6 address (allow-list entries)
        return v if _address(v) else None
    name, _, port = v.partition(":")
    if not port.isdigit() and port:
        return None
    name = name[:-1] if name.endswith(".") else name
    return name if _address(name) or _NAME.fullmatch(name) else None


def _address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def machine_names() -> set[str]:
    """This machine's own names: its host name, its fully qualified name and, for a
    one-label host name, ``NAME.local`` (lowercase)."""
    names = set()
    for name in (socket.gethostname(), socket.getfqdn()):
        name = host_name(name or "")
        if name:
            names.add(name)
            if "." not in name:
                names.add(name + ".local")
    return names


class HostPolicy:
    """Which Host header values a server bound to ``bind`` accepts (see the module
    docstring): ``extra`` are the ``--allowed-hosts`` entries (``*``: any)."""

    def __init__(self, bind: str, extra: Iterable[str] = ()):
        extra = list(extra)
        self.any = "*" in (e.strip() for e in extra)
        names = {*DEFAULT_HOSTS, *(e for e in extra if e.strip() != "*")}
        if bind.strip().lower() in WILDCARD_BINDS:
            try:
                names |= machine_names()
            except OSError as e:
                log.warning("the machine's host names are unknown (%s); use --allowed-hosts", e)
        else:
            names.add(bind)
        self.names = frozenset(n for n in map(host_name, names) if n)

    def allows(self, host: Optional[str]) -> bool:
        """True for a Host header value (None: absent) this server accepts."""
        if self.any or host is None or not host.strip():
            return True
        name = host_name(host)
        if name is None:
            return False
        return name in self.names or name.endswith(".localhost") or _address(name)

    def check(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Check every ``Host`` header among raw ASGI ``headers``.

        Raises:
            HostNotAllowed: 421 for a Host this server does not accept.
        """
        for key, value in headers:
            if key.lower() == b"host":
                host = value.decode("latin-1")
                if not self.allows(host):
                    raise HostNotAllowed(host)
