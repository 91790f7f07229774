"""The framed transport's method ids are a wire format: pinned here, one by one.

An id is ``service_number << 8 | method_number``, each rpc declaring its number in the ``.proto``.
A changed id would make older framed clients call the wrong method, so this table only ever grows.
"""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool

from fs3 import meta_pb2
from fs3.rpc.methods import SERVICE_NUMBERS, check_method_numbers, declared_method_number, method_by_id, service_spec

PINNED: dict[str, int] = {
    "Mgmtd.Heartbeat": 0x0100,
    "Mgmtd.GetRoutingInfo": 0x0101,
    "Mgmtd.ListNodes": 0x0102,
    "Mgmtd.ListTargets": 0x0103,
    "Mgmtd.ListChains": 0x0104,
    "Mgmtd.CreateChainTable": 0x0105,
    "Mgmtd.MarkTargetOffline": 0x0106,
    "Mgmtd.Drain": 0x0107,
    "Mgmtd.Undrain": 0x0108,
    "Mgmtd.Rebalance": 0x0109,
    "Mgmtd.ListMoves": 0x010A,
    "Storage.Update": 0x0200,
    "Storage.Forward": 0x0201,
    "Storage.Read": 0x0202,
    "Storage.QueryCommitted": 0x0203,
    "Storage.DumpChunkMeta": 0x0204,
    "Storage.SyncDone": 0x0205,
    "Storage.TargetStats": 0x0206,
    "Storage.SyncChannels": 0x0207,
    "Storage.BatchRead": 0x0208,
    "Storage.ScrubStatus": 0x0214,
    "Meta.StatFs": 0x0300,
    "Meta.Lookup": 0x0301,
    "Meta.BatchStat": 0x0302,
    "Meta.Open": 0x0303,
    "Meta.MakeNode": 0x0304,
    "Meta.ReadLink": 0x0305,
    "Meta.Link": 0x0306,
    "Meta.Remove": 0x0307,
    "Meta.Rename": 0x0308,
    "Meta.ReadDir": 0x0309,
    "Meta.SetAttr": 0x030a,
    "Meta.GetXattr": 0x030b,
    "Meta.SetXattr": 0x030c,
    "Meta.ListXattr": 0x030d,
    "Meta.RemoveXattr": 0x030e,
    "Meta.Close": 0x030f,
    "Meta.Sync": 0x0310,
    "Meta.SetLayout": 0x0311,
    "Meta.RenewClient": 0x0312,
    "Meta.Fsck": 0x0313,
    "Meta.WhoAmI": 0x0314,
    "Meta.AddUser": 0x0315,
    "Meta.ListUsers": 0x0316,
    "Meta.RemoveUser": 0x0317,
    "Meta.RotateUser": 0x0318,
    "Meta.GrantCapability": 0x0319,
    "Meta.CloseSessions": 0x031A,
    "Meta.TrashList": 0x031B,
    "Meta.TrashRestore": 0x031C,
    "Meta.TrashPurge": 0x031D,
    "Meta.QuotaSet": 0x031E,
    "Meta.QuotaGet": 0x031F,
    "Meta.QuotaList": 0x0320,
    "Meta.QuotaUnset": 0x0321,
    "Meta.QuotaCheck": 0x0322,
    "Meta.QuotaReserve": 0x0323,
}


def test_every_method_id_is_pinned_and_unchanged() -> None:
    actual = {f"{service}.{m.name}": m.method_id for service in SERVICE_NUMBERS for m in service_spec(service).methods}
    assert actual == PINNED


def test_ids_resolve_back_to_their_methods() -> None:
    for qualified, method_id in PINNED.items():
        method = method_by_id(method_id)
        assert method is not None and f"{method.service}.{method.name}" == qualified


def test_a_method_without_a_number_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Meta\.NewRpc declares no method number"):
        check_method_numbers("Meta", {"Open": 3, "NewRpc": None})


def test_duplicate_method_numbers_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Meta\.Clone: method number 3 is already Meta\.Open"):
        check_method_numbers("Meta", {"Open": 3, "Clone": 3})


@pytest.mark.parametrize("number", [-1, 256])
def test_method_numbers_fit_the_header_byte(number: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        check_method_numbers("Meta", {"Open": number})


def testdeclared_method_numbers_are_accepted() -> None:
    assert check_method_numbers("Meta", {"Open": 3, "Close": 15}) == {"Open": 3, "Close": 15}



def test_an_rpc_declaring_no_number_is_read_as_none() -> None:
    """The check sees an rpc written without the option as undeclared, not as number 0."""
    proto = descriptor_pb2.FileDescriptorProto(name="undeclared.proto", package="undeclared")
    proto.message_type.add(name="Req")
    service = proto.service.add(name="Svc")
    service.method.add(name="Call", input_type=".undeclared.Req", output_type=".undeclared.Req")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    assert declared_method_number(pool.FindServiceByName("undeclared.Svc").methods[0]) is None
    assert declared_method_number(meta_pb2.DESCRIPTOR.services_by_name["Meta"].methods_by_name["Open"]) == 3
