"""HAI Platform: the time-sharing scheduler that shares a cluster's nodes among training jobs.

Jobs are submitted with a node count, a priority and a node group; the scheduler places them on
whole nodes by priority and quota, suspends running jobs (they checkpoint to fs3 and exit) to make
room for higher-priority ones, resumes them later, possibly on other nodes, and restarts jobs hit
by faults. The rules are one pure module, :mod:`hai.rules`: no I/O, no clock, no randomness;
the server keeps the state they return in a database through :mod:`hai.store`. On each node,
:mod:`hai.launcher` starts a job's ranks, carries their logs to fs3 and suspends or stops them;
:mod:`hai.client` is what the job calls to learn of a suspend and acknowledge it.
"""
