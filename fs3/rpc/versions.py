"""Protocol versions and the one rule that says whether two fs3 processes can talk.

Every process speaks a range of protocol versions, ``[PROTOCOL_VERSION_MIN, PROTOCOL_VERSION]``
(an operator may lower the top with ``FS3_PROTOCOL_VERSION_MAX`` during a rolling upgrade, as
Kafka's ``inter.broker.protocol.version``). Two processes talk when their ranges overlap, and then
speak the highest version both know (:func:`negotiate`); otherwise each refuses with a
:class:`~fs3.common.errors.ProtocolError` that names both ranges and which side to upgrade.

Protocol 1 is what every release before this module spoke: the framed HELLO carries only the
token, gRPC calls carry no version, heartbeats no version fields. A peer that says nothing is a
protocol-1 peer. Protocol 2 = protocol 1 + the version exchange itself: the framed HELLO and
HELLO_ACK carry the sender's range in header fields protocol 1 leaves zero and ignores
(``method_id`` = highest, ``status`` = lowest in a HELLO; ``method_id`` = the version chosen in a
HELLO_ACK), gRPC calls carry ``x-fs3-protocol`` metadata, and heartbeats carry the node's range
and release (``NodeInfo.protocol_version``...). A server answers a protocol-1 client's HELLO with
the exact bytes protocol 1 expects, so an old client never sees anything new.

The frame header's own ``version`` byte (fs3/rpc/framing.py) is the frame *layout*, not the
protocol: it stays 1 while new protocols only add meaning to fields old ones ignore; a later
layout change bumps it, and a server answers a frame of a layout it cannot parse with an error
frame of layout 1, which every release reads.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

from fs3 import mgmtd_pb2 as mpb
from fs3.common.errors import InvalidArgument, ProtocolError

__all__ = ["PROTOCOL_VERSION", "PROTOCOL_VERSION_MAX_ENV", "PROTOCOL_VERSION_MIN", "RELEASE", "VersionRange",
           "accept_choice", "advertised_range", "apply_config_pin", "negotiate", "protocol_number",
           "range_from_wire", "stamp_heartbeat"]

#: The newest protocol this code speaks.
PROTOCOL_VERSION = 2
#: The oldest protocol this code still speaks: peers of an older one are refused.
PROTOCOL_VERSION_MIN = 1
#: This code's release (what ``fs3 admin nodes`` shows next to the protocol).
# Read from the package already imported (importing this module imports ``fs3`` first), not by
# ``from fs3 import``: the package root re-exports the client API, which the rpc layer may not import.
RELEASE: str = sys.modules["fs3"].__version__
#: The operator's pin: speak at most this protocol (during a rolling upgrade, until every node runs
#: the new release). Unset: :data:`PROTOCOL_VERSION`.
PROTOCOL_VERSION_MAX_ENV = "FS3_PROTOCOL_VERSION_MAX"


class VersionRange:
    """The protocol versions one process speaks, ``low..high`` inclusive."""

    __slots__ = ("high", "low")

    def __init__(self, low: int, high: int) -> None:
        if not 1 <= low <= high:
            raise ValueError(f"bad protocol range {low}..{high}: need 1 <= low <= high")
        self.low, self.high = low, high

    def __repr__(self) -> str:
        return f"VersionRange({self.low}, {self.high})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VersionRange) and (self.low, self.high) == (other.low, other.high)

    def __hash__(self) -> int:
        return hash((self.low, self.high))

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}..{self.high}"


def advertised_range(environ: dict[str, str] | None = None) -> VersionRange:
    """What this process speaks: ``PROTOCOL_VERSION_MIN..PROTOCOL_VERSION``, the top lowered by
    ``$FS3_PROTOCOL_VERSION_MAX`` when set. A pin outside that range is refused (a typo must not
    silently leave the cluster on a protocol the operator did not choose) with
    :class:`~fs3.common.errors.InvalidArgument`, which every command reports in one line."""
    raw = (os.environ if environ is None else environ).get(PROTOCOL_VERSION_MAX_ENV, "").strip()
    if not raw:
        return VersionRange(PROTOCOL_VERSION_MIN, PROTOCOL_VERSION)
    # isascii: str.isdigit() admits digits int() refuses ("²"), which would escape as a bare ValueError.
    if not (raw.isascii() and raw.isdigit()) or not PROTOCOL_VERSION_MIN <= int(raw) <= PROTOCOL_VERSION:
        raise InvalidArgument(f"{PROTOCOL_VERSION_MAX_ENV}={raw!r}: this release speaks protocol "
                         f"{PROTOCOL_VERSION_MIN}..{PROTOCOL_VERSION}; pin one of those")
    return VersionRange(PROTOCOL_VERSION_MIN, int(raw))


def apply_config_pin(protocol_version_max: int, environ: MutableMapping[str, str] | None = None) -> None:
    """A service config's ``protocol_version_max`` (0: none) made this process's pin: written to
    ``$FS3_PROTOCOL_VERSION_MAX``, which every channel and server the process (and its children)
    makes reads. Operators keep settings in the TOML; the environment stays for processes without
    one (clients, mounts). Both set and different is refused, as is a version this release lacks."""
    if not protocol_version_max:
        return
    env = os.environ if environ is None else environ
    if not PROTOCOL_VERSION_MIN <= protocol_version_max <= PROTOCOL_VERSION:
        raise InvalidArgument(f"protocol_version_max = {protocol_version_max}: this release speaks protocol "
                              f"{PROTOCOL_VERSION_MIN}..{PROTOCOL_VERSION}; pin one of those (or 0: no pin)")
    already = env.get(PROTOCOL_VERSION_MAX_ENV, "").strip()
    if already and already != str(protocol_version_max):
        raise InvalidArgument(f"protocol_version_max = {protocol_version_max} in the config, but "
                              f"{PROTOCOL_VERSION_MAX_ENV}={already!r} in the environment: set one of them")
    env[PROTOCOL_VERSION_MAX_ENV] = str(protocol_version_max)


def stamp_heartbeat(req: mpb.HeartbeatReq, environ: dict[str, str] | None = None) -> mpb.HeartbeatReq:
    """``req`` with what a node tells mgmtd of itself: its protocol range and release."""
    spoken = advertised_range(environ)
    req.protocol_version, req.protocol_version_min, req.release = spoken.high, spoken.low, RELEASE
    return req


def protocol_number(text: str) -> int | None:
    """``text`` as a protocol number a peer sent (gRPC metadata), or None when it is not one: only
    ASCII digits, at most 0xFFFF (str.isdigit() alone admits "²", which int() refuses)."""
    if not (text.isascii() and text.isdigit()) or len(text) > 5 or int(text) > 0xFFFF:
        return None
    return int(text)


def range_from_wire(high: int, low: int = 0) -> VersionRange:
    """A peer's range from the fields it sent; 0 (absent: a protocol-1 peer, or a field it left
    out) reads as 1. A nonsensical range (low above high) is a malformed peer."""
    high, low = high or 1, low or 1
    if low > high:
        raise ProtocolError(f"peer advertises protocol {low}..{high}: its lowest is above its highest")
    return VersionRange(low, high)


def negotiate(local: VersionRange, peer: VersionRange, peer_name: str, *, local_name: str = "this node",
              release: str = "") -> int:
    """The protocol ``local`` and ``peer`` speak together: the highest both know.

    Raises :class:`ProtocolError` when the ranges do not overlap, naming both ranges and what to do:
    a peer too old is upgraded (or this side is downgraded to a release that still speaks its
    protocol); a peer too new means this side is upgraded first.
    """
    if peer.high < local.low:
        raise ProtocolError(
            f"{peer_name} speaks protocol {peer}{_of(release)}, {local_name} speaks {local} (release {RELEASE}): "
            f"{peer_name} is too old; upgrade it to a release that speaks protocol {local.low} or later "
            f"before connecting it to this one")
    if peer.low > local.high:
        raise ProtocolError(
            f"{peer_name} speaks protocol {peer}{_of(release)}, {local_name} speaks {local} (release {RELEASE}): "
            f"{local_name} is too old for it; upgrade {local_name} to a release that speaks "
            f"protocol {peer.low} or later")
    return min(local.high, peer.high)


def accept_choice(local: VersionRange, chosen: int, peer_name: str, *, local_name: str = "this client") -> int:
    """The protocol a server answered it chose (0: a protocol-1 server, which says nothing), as the
    client ``local`` takes it. A correct server chooses within the range the client offered: one
    that names a version above it is broken or lying, and is refused rather than read as the
    client's own highest; one below the client's lowest is too old (:func:`negotiate`)."""
    if chosen > local.high:
        raise ProtocolError(f"{peer_name} chose protocol {chosen}, which {local_name} never offered "
                            f"(it speaks {local}): a broken server, or one that is not fs3")
    return negotiate(local, range_from_wire(chosen), peer_name, local_name=local_name)


def _of(release: str) -> str:
    return f" (release {release})" if release else ""
