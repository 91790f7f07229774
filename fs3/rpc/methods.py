"""Service and method tables derived from the proto descriptors.

The ``.proto`` files are the contract: method names, request and response types, and the
method ids used by the framed transport all come from the generated descriptors, never from a
second hand-written list. A method id is ``service_number << 8 | method_number``, where every rpc
declares its number (``option (fs3.method_number) = N;``) instead of taking its position in the
service: inserting or reordering rpcs then never changes what an older framed client sends.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message

from fs3 import common_pb2, meta_pb2, mgmtd_pb2, storage_pb2

__all__ = ["SERVICE_NUMBERS", "MethodSpec", "ServiceSpec", "check_method_numbers", "declared_method_number",
           "method_by_id", "service_spec"]

# Stable numbers for the framed transport. Append only.
SERVICE_NUMBERS: dict[str, int] = {"Mgmtd": 1, "Storage": 2, "Meta": 3}
PAYLOAD_FIELD = "payload"
# A method number is the low byte of the 16-bit id the framed header carries.
METHOD_NUMBER_MAX = 0xFF
# The generated stub types the option as a plain FieldDescriptor, which the stubs of the options'
# extension map do not accept; at run time it is the extension that map takes.
_METHOD_NUMBER: Any = common_pb2.method_number

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


def check_method_numbers(service: str, declared: Mapping[str, int | None]) -> dict[str, int]:
    """The method numbers of ``service`` as declared (``None``: the rpc declares none).

    Refuses an rpc without a number, a number outside the header's byte and two rpcs sharing one:
    each would make a framed id mean a different method to an older or newer build.
    """
    numbers: dict[str, int] = {}
    owner: dict[int, str] = {}
    for method, number in declared.items():
        if number is None:
            raise ValueError(f"rpc {service}.{method} declares no method number "
                             f"(add {{ option (fs3.method_number) = N; }} with an unused N)")
        if not 0 <= number <= METHOD_NUMBER_MAX:
            raise ValueError(f"rpc {service}.{method}: method number {number} outside [0, {METHOD_NUMBER_MAX}]")
        if number in owner:
            raise ValueError(f"rpc {service}.{method}: method number {number} is already {service}.{owner[number]}")
        owner[number] = method
        numbers[method] = number
    return numbers


def declared_method_number(method: MethodDescriptor) -> int | None:
    """The number an rpc declares with ``option (fs3.method_number)`` (``None``: it declares none)."""
    options = method.GetOptions()
    if not options.HasExtension(_METHOD_NUMBER):
        return None
    return int(options.Extensions[_METHOD_NUMBER])


@cache
def service_spec(name: str) -> ServiceSpec:
    """The table of service ``name`` (``"Mgmtd"``, ``"Storage"``, ...)."""
    module = _MODULES[name]
    descriptor = module.DESCRIPTOR.services_by_name[name]
    number = SERVICE_NUMBERS[name]
    numbers = check_method_numbers(name, {m.name: declared_method_number(m) for m in descriptor.methods})
    methods = []
    for method in descriptor.methods:
        request_type = getattr(module, method.input_type.name, None) or _find_type(method.input_type.full_name)
        response_type = getattr(module, method.output_type.name, None) or _find_type(method.output_type.full_name)
        methods.append(MethodSpec(name, method.name, (number << 8) | numbers[method.name], request_type,
                                  response_type))
    return ServiceSpec(name, number, tuple(methods))


def _find_type(full_name: str) -> type[Message]:
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
