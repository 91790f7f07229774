"""Hostile review of issue 22, second round (the round-trip deadline, path hints, node ids, the
private PostgreSQL and fs3 local on it): findings as tests.

Each test failed before its fix.
"""

from __future__ import annotations

import pytest

from fs3.common.errors import Unavailable


def test_a_password_with_a_colon_is_redacted_whole() -> None:
    """A URI's password may hold ``:`` (libpq splits user from password at the first one)."""
    from fs3.kv.postgres import redact_url

    shown = redact_url("postgresql://fs3:top:s3cret@h:5432/db")
    assert "top" not in shown and "s3cret" not in shown, shown
    assert shown == "postgresql://fs3:***@h:5432/db"


@pytest.mark.parametrize("url", [
    "postgresql://fs3:s3c%zzret@127.0.0.1:1/db",  # a bad percent escape in the password
    "postgresql://fs3@127.0.0.1:1/db?password=%zzs3cret",  # and in ?password=
])
def test_a_url_libpq_cannot_parse_does_not_echo_its_password(url: str) -> None:
    """libpq quotes the token it cannot decode; ``fs3 local up --pg-url`` printed it."""
    from fs3.cluster.postgres import check_reachable

    with pytest.raises(Unavailable) as err:
        check_reachable(url, timeout_s=1)
    assert "s3c" not in str(err.value), str(err.value)
