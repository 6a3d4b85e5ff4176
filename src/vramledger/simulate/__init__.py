"""Simulate a whole training run: every step at its padded length, evaluations and ``empty_cache`` calls,
through one caching-allocator model whose state carries across steps.

- ``lengths``: sample lengths from a file, summary statistics or a dataset;
- ``batching``: order (shuffle, group_by_length, sorted), packing, padding, as the frameworks build batches;
- ``schedule``: the run's units (load, optimizer steps, evaluations, ``empty_cache``);
- ``templates``: one trace at a reference length, each allocation re-sized at any length;
- ``engine``: the replay, memoised on the allocator state;
- ``api``: ``simulate`` and its result; ``remedies``: the same run under each remedy.
"""
