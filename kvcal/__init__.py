"""kvcal: calibrate, evaluate and compare quantized KV caches."""

__version__ = "0.1.0"
