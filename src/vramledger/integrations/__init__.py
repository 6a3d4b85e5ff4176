"""Callbacks that watch GPU memory in a real run: the HF Trainer (and TRL's trainers), Lightning, a plain loop.

- ``vramledger.integrations.hf.VramledgerCallback`` (needs transformers);
- ``vramledger.integrations.lightning.VramledgerLightningCallback`` (needs lightning; importable without it);
- ``vramledger.integrations.loop.watch_memory`` for a hand-written PyTorch loop.

All three share ``integrations.watcher.MemoryWatcher``; see docs/integrations.md.
"""
