"""The metadata service's explicit limits, each with why it has its value.

Every bound on what one request may ask, one transaction may read or write, and how often meta
tries again lives here, so that a reader sees in one page what meta promises never to exceed.
The modules that use a limit import it by name (``ops.ANCESTOR_WALK_MAX`` and the like stay
importable where they were). Each is tested at its edge in ``tests/test_meta_limits.py``: at the
limit the request is served, one past it is refused with a clear error and nothing changes.

What one request may carry is bounded first by the transport (``FramedLimits.msg_max_bytes``,
16 MiB a message); the limits below bound what meta does with it. The largest request they let
through is a :data:`BATCH_STAT_MAX` batch of inode ids (about 100 KB).
"""

from __future__ import annotations

__all__ = [
    "ANCESTOR_WALK_MAX",
    "ANCESTRY_ATTEMPTS",
    "ANSWER_DELETE_PAGE",
    "BACKLOG_COUNT_MAX",
    "BATCH_STAT_MAX",
    "CHUNK_INDEX_END",
    "CHUNK_PAGE_MAX",
    "JOB_SCAN_PAGE",
    "LENGTH_PROBE_ATTEMPTS",
    "LIST_RETRY_BACKOFF_MAX_MS",
    "LIST_RETRY_BACKOFF_MS",
    "PRUNE_PAGE",
    "READDIR_LIMIT_MAX",
    "REMOVE_PARALLEL",
    "TRUNCATE_ATTEMPTS",
    "USER_COMMENT_MAX",
    "USER_GROUPS_MAX",
    "USER_NAME_MAX",
    "USER_PAGE_MAX",
    "XATTR_DELETE_PAGE",
    "XATTR_LIST_PAGE",
]

# -- what one request may ask --------------------------------------------------------------------

# Inodes one BatchStat reads, in one read transaction: 10,000 inodes is a few MiB of answer and a
# transaction that still reads in well under a second; a bigger batch is InvalidArgument.
BATCH_STAT_MAX = 10_000
# Entries one ReadDir page returns (a larger ``limit`` is clamped: paging is the caller's way on).
# The same reasoning as a batch: one read transaction, an answer of a few MiB with attributes.
READDIR_LIMIT_MAX = 10_000
# A user token's record: its name and comment are for operators (a line in a listing), and its
# supplementary groups are sent with every request it makes. Linux allows 65,536 groups; a token
# is one person's or one job's identity, and 64 keeps a record (and each request) small.
USER_NAME_MAX = 64
USER_COMMENT_MAX = 256
USER_GROUPS_MAX = 64
# Records one ListUsers page returns (a larger ``limit`` is clamped), in one read transaction.
USER_PAGE_MAX = 1000
# Linux's xattr limits (XATTR_NAME_MAX, XATTR_SIZE_MAX, and one listxattr answer: a longer list is
# E2BIG) are the POSIX vocabulary's: fs3/common/posix.py, shared with the client.

# -- what one transaction may read or write ------------------------------------------------------

# Attributes a listing reads at a time (values come with them: at most 4 MiB per read).
XATTR_LIST_PAGE = 64
# Attributes a removal deletes in its own transaction (at most 4 MiB of values read); the GC job
# deletes the rest as many per transaction.
XATTR_DELETE_PAGE = 64
# Parent links one transaction follows. Linux has no depth limit for directory trees; a rename
# that must look further above its destination has the service walk on (:class:`AncestryUnknown`).
ANCESTOR_WALK_MAX = 1024
# Leases, expired clients or sessions read per page, and saved answers (one key each) deleted
# per transaction when a client reports them complete or its lease lapsed: a transaction of a
# thousand small writes commits in milliseconds, and a client with more is cleaned up over
# several, each resumable (what is deleted is gone; the next page starts where it stopped).
PRUNE_PAGE = 1000
ANSWER_DELETE_PAGE = PRUNE_PAGE
# Truncate or GC jobs read per scan of their queue. Each job then runs its own storage calls, so
# a page is work for seconds; the scan goes on past jobs that failed, so none starves the rest.
JOB_SCAN_PAGE = 100
# Jobs counted per queue for the backlog gauges at each maintenance pass: a gauge at this value
# means "at least this many" (a queue that long is what the alert is for; its exact length is not).
BACKLOG_COUNT_MAX = 10_000
# Largest ``chunk_page`` (chunks listed per storage call of a job or a probe): a page is a
# storage answer of about 100 bytes a chunk, so 10,000 is about 1 MB.
CHUNK_PAGE_MAX = 10_000
# Chunk indexes are 32-bit (the chunk id's index field): listings never look past this.
CHUNK_INDEX_END = 1 << 32

# -- concurrency and retries ---------------------------------------------------------------------

# Storage calls (listings, removals) one job has in flight at once, across its chains.
REMOVE_PARALLEL = 16
# Probes of a file's length a close, sync or expiry makes before it settles for the size meta
# has: each probe after the first means another truncate came between (another meta server).
LENGTH_PROBE_ATTEMPTS = 5
# Runs of a rename whose destination is deeper than one transaction looks: each run may need
# one more answer from a walk, and a directory moved meanwhile costs a walk again.
ANCESTRY_ATTEMPTS = 8
# A request that meets another truncate of its inode (or a rename moving the name it resolved)
# runs again at most this often.
TRUNCATE_ATTEMPTS = 8
# Backoff between listings of a chain that no serving member answered (then the storage client's
# retry budget ends them).
LIST_RETRY_BACKOFF_MS = 50
LIST_RETRY_BACKOFF_MAX_MS = 1_000

# Sessions one CloseSessions request may end (one transaction: its size stays bounded).
CLOSE_SESSIONS_MAX = 256
