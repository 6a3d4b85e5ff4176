"""The model of PyTorch's CUDA caching allocator: allocation events in, reserved memory and the OOM point out.

A port of ``c10/cuda/CUDACachingAllocator.cpp`` used by every engine: ``trace`` replays its recorded events
through it, ``analytic`` derives its closed-form reserve from the same rules, and ``gpucheck`` compares it with
the real allocator on a GPU. It imports nothing from ``analytic`` or ``trace``.

- ``conf``: the allocator's constants and ``PYTORCH_CUDA_ALLOC_CONF`` parsing;
- ``blocks``: blocks and the size-ordered pools;
- ``model``: ``CachingAllocatorModel`` (malloc, free, splitting, release-and-retry, expandable segments);
- ``replay``: a stream of allocation events through the model, peak reserved and the OOM point;
- ``gpucheck``: the same stream on a real GPU, for comparison.
"""
