"""The FUSE mount: a thin pyfuse3 adapter over :mod:`fs3.vfs` (see :mod:`fs3.fuse.mount`)."""
