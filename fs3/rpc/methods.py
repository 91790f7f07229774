"""Service and method tables derived from the proto descriptors.

The ``.proto`` files are the contract: method names, request and response types, and the
method ids used by the framed transport all come from the generated descriptors, never from a
second hand-written list. A method id is ``service_number << 8 | method_index``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from google.protobuf.message import Message

from fs3 import meta_pb2, mgmtd_pb2, storage_pb2

__all__ = ["SERVICE_NUMBERS", "MethodSpec", "ServiceSpec", "method_by_id", "service_spec"]

# Stable numbers for the framed transport. Append only.
SERVICE_NUMBERS: dict[str, int] = {"Mgmtd": 1, "Storage": 2, "Meta": 3}
PAYLOAD_FIELD = "payload"

_MODULES = {"Mgmtd": mgmtd_pb2, "Storage": storage_pb2, "Meta": meta_pb2}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@dataclass(frozen=True)
class MethodSpec:
    service: str
    name: str
    method_id: int
    request_type: type[Message]
    response_type: type[Message]

    @property
    def handler_name(self) -> str:
        """The servicer attribute that implements this method (snake_case)."""
        return _snake(self.name)

    @property
    def grpc_path(self) -> str:
        return f"/fs3.{self.service}/{self.name}"

    @property
    def request_has_payload(self) -> bool:
        return PAYLOAD_FIELD in self.request_type.DESCRIPTOR.fields_by_name

    @property
    def response_has_payload(self) -> bool:
        return PAYLOAD_FIELD in self.response_type.DESCRIPTOR.fields_by_name


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    number: int
    methods: tuple[MethodSpec, ...]

    def method(self, name: str) -> MethodSpec:
        for m in self.methods:
            if m.name == name:
                return m
        raise KeyError(f"{self.name} has no method {name}")


@cache
def service_spec(name: str) -> ServiceSpec:
    """The table of service ``name`` (``"Mgmtd"``, ``"Storage"``, ...)."""
    module = _MODULES[name]
    descriptor = module.DESCRIPTOR.services_by_name[name]
    number = SERVICE_NUMBERS[name]
    methods = []
    for index, method in enumerate(descriptor.methods):
        request_type = getattr(module, method.input_type.name, None) or _find_type(method.input_type.full_name)
        response_type = getattr(module, method.output_type.name, None) or _find_type(method.output_type.full_name)
        methods.append(MethodSpec(name, method.name, (number << 8) | index, request_type, response_type))
    return ServiceSpec(name, number, tuple(methods))


def _find_type(full_name: str) -> type[Message]:
    from fs3 import common_pb2

    short = full_name.rsplit(".", 1)[-1]
    cls = getattr(common_pb2, short)
    assert isinstance(cls, type)
    return cls


@cache
def _all_methods() -> dict[int, MethodSpec]:
    table: dict[int, MethodSpec] = {}
    for name in _MODULES:
        for m in service_spec(name).methods:
            table[m.method_id] = m
    return table


def method_by_id(method_id: int) -> MethodSpec | None:
    return _all_methods().get(method_id)
