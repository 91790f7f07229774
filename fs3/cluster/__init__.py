"""One description of a cluster, built three ways.

:mod:`~fs3.cluster.topology` says what a cluster is made of (mgmtd, storage nodes and their
targets, the chain table, meta) and what each part is called; :mod:`~fs3.cluster.services` wires
each service from the things that differ between the ways a cluster runs (transport, clock, event
loop, stores), which the caller injects; :mod:`~fs3.cluster.processes` turns the description into
config files and child processes. The simulator, the in-process test cluster, ``fs3 local`` and
the chaos harness all build their clusters from these.
"""
