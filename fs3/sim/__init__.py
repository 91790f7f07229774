"""Deterministic simulation of mgmtd, storage nodes and clients in one process.

Everything runs on a virtual-time asyncio loop (:mod:`fs3.sim.loop`) with one seeded random
source; the network (:mod:`fs3.sim.network`) delays, drops and reorders messages; processes
crash and restart; disks lose what was not synced. A failing seed prints itself and replays
exactly: ``python -m fs3.sim --seed N``.
"""
