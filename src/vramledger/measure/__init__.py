"""The GPU harness (one isolated worker process per trial) and the OOM-cliff search.

- ``harness.measure(model, train)``: build the model from its config with random weights on the GPU, run real
  training steps, and return the measured Ledger (engine ``measure``).
- ``search.find_max(fits, predicted=…, upper=…)``: the largest batch or length that runs, seeded with the
  estimate's prediction.
- ``results``: the accuracy suite's JSONL records and error statistics.
"""
