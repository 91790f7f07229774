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

from haiscale import vml
from haiscale.dist import ParallelContext, destroy, get_context, init
from haiscale.topology import ParallelLayout

# Before any op of this process can run on several threads: MKL resolves each vector-math kernel on
# its first call, and a first call made by several threads at once can silently compute one
# thread's chunk at low accuracy (haiscale/vml.py).
vml.warm_up()

__all__ = ["ParallelContext", "ParallelLayout", "destroy", "get_context", "init"]
