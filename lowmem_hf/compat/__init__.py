"""The one place lowmem_hf touches upstream private names or release-dependent APIs.

torch, transformers and DeepSpeed keep some of what a loader needs behind underscore names (transformers' dtype
decision, its auto-class routing, its finishing step; torch's strided FSDP2 placement and the c10d store;
DeepSpeed's partitioning hook). Any release may move or drop them. Each is wrapped here in a small function or
constant whose docstring names the releases it was checked against, so that:

- ``import lowmem_hf`` and a plain load never fail because a release lacks a name: a missing name is looked up
  at the point of use, where it raises ``UpstreamAPIError`` naming the feature, the release it needs and the
  release found;
- ``tests/test_layout.py`` refuses an upstream private name anywhere else in the package.

This package imports nothing itself; each submodule imports its upstream library at module level, and only the
stages that already need that library import it, so ``import lowmem_hf`` stays as cheap as ``import transformers``.
"""
