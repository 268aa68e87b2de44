"""The kernel cache: content-addressed cubins on disk, an in-memory map in front.

`flexgen.cache.jit.get_kernel(spec)` is the one entry point the runtime needs. This package module
imports nothing, so that a lower layer can read `flexgen.cache.paths` without loading the compilers.
"""
