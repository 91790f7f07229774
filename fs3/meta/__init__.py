"""The metadata service: the namespace as transactions over a KV store.

:mod:`fs3.meta.ops` holds every POSIX operation as a pure transaction function written against
:class:`fs3.kv.api.Transaction`; :mod:`fs3.meta.schema` every key it stores; :mod:`fs3.meta.service`
and :mod:`fs3.meta.server` the shell that runs them and talks to storage. Clients never import this
package: what they share with it (open flags, permissions, layouts) is in :mod:`fs3.common`.
"""
