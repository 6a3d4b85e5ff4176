"""vramledger: where did my GPU memory go, where is the cliff, and what should I change?"""

__version__ = "0.1.0"
