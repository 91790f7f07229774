"""Transports for fs3 services: gRPC (public API, admin) and a lean framed protocol (hot paths).

One servicer object serves both. A servicer is a plain class whose coroutine methods are named
after the proto methods in snake_case and take ``(request, payload)`` and return
``(response, payload)``; ``payload`` is the bulk data that travels outside the protobuf message.
"""
