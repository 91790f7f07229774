"""Second hostile-review cases for profiles, URLs, fork safety, fsspec, metrics and the operator
commands: each one a way the client or a service could send data to the wrong cluster, lose data,
leak, or grow without bound, that once did."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from fs3.client.fsspec_impl import FS3FileSystem
from fs3.common.errors import StatusCode
from fs3.common.metrics import ServiceMetrics
from fs3.rpc.dispatch import Dispatcher


@pytest.mark.parametrize("url", ["fs3://otherhost.example/data/x", "fs3://prod@otherhost.example/data/x",
                                 "fs3://prod:secret-word@/data/x"])
def test_a_url_naming_a_host_without_a_port_or_a_password_is_refused_not_sent_elsewhere(url: str) -> None:
    # Such a URL named a cluster (or a secret) the client silently dropped: the file went to the
    # default profile's, or $FS3_MGMTD's, cluster instead.
    with pytest.raises(ValueError, match="fs3 URL") as caught:
        FS3FileSystem._get_kwargs_from_urls(url)
    assert "secret-word" not in str(caught.value)


def test_urls_that_name_a_cluster_or_a_profile_still_resolve() -> None:
    assert FS3FileSystem._get_kwargs_from_urls("fs3://h:9000/x") == {"mgmtd": "h:9000"}
    assert FS3FileSystem._get_kwargs_from_urls("fs3://prod@/x") == {"profile": "prod"}
    assert FS3FileSystem._get_kwargs_from_urls("fs3://prod@h:9000/x") == {"profile": "prod", "mgmtd": "h:9000"}
    assert FS3FileSystem._get_kwargs_from_urls("fs3:///x") == {}
    assert FS3FileSystem._get_kwargs_from_urls("/x") == {}


def test_unknown_method_ids_share_one_metrics_label() -> None:
    # Each unauthenticated connection gets one request answered: a new method id per connection
    # added a request counter and a latency histogram to /metrics, without bound.
    registry = CollectorRegistry()
    dispatcher = Dispatcher(token="t", metrics=ServiceMetrics("mgmtd", registry))

    async def send_unknown_ids() -> None:
        for method_id in range(60_000, 60_200):
            reply = await dispatcher.dispatch(method_id, b"", b"", None)
            assert reply.status == StatusCode.UNAUTHENTICATED

    asyncio.run(send_unknown_ids())
    methods = {sample.labels.get("method") for metric in registry.collect() for sample in metric.samples
               if sample.name.startswith("fs3_rpc_")}
    assert methods == {"unknown"}


