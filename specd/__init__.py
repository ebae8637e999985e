"""specd: speculative decoding with adaptive draft stopping (see docs/).

The core package is pure: sampling, verification, stopping policies, the engine loop,
models and statistics. It imports no gRPC, web framework or metrics library.
"""

__version__ = "0.1.0"
