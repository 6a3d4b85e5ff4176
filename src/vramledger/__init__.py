"""vramledger: where did my GPU memory go, where is the cliff, and what should I change?"""

from vramledger._version import __version__ as __version__


def estimate(*args: object, **kwargs: object) -> object:
    """``vramledger.estimate(model, gpu=..., method=..., batch=..., seq=...)``: the notebook entry point.

    See ``vramledger.api.estimate`` (imported on first use, so that ``import vramledger`` stays instant).
    """
    from vramledger.api import estimate as _estimate

    return _estimate(*args, **kwargs)  # type: ignore[arg-type]
