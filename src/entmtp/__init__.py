"""entmtp: entropy-scheduled multi-token-prediction self-speculative decoding."""

__version__ = "0.1.0"
