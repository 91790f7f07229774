"""HaiScale: data-, fully-sharded- and pipeline-parallel training on HFReduce, with datasets read from
fs3 and checkpoints written to fs3 (the Fire-Flyer AI-HPC paper's training library, §V and §VII-A).

    import haiscale
    ctx = haiscale.init()                                   # torch's launcher variables
    model = haiscale.ddp.DistributedDataParallel(model)     # or haiscale.fsdp, haiscale.pipeline
    ...
    haiscale.destroy()

See ``haiscale/README.md``.
"""

from __future__ import annotations

from haiscale.dist import ParallelContext, destroy, get_context, init
from haiscale.topology import ParallelLayout

__all__ = ["ParallelContext", "ParallelLayout", "destroy", "get_context", "init"]
