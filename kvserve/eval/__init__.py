"""`kvserve eval`: what a KV cache setting costs in quality, measured through the engine's own paged path."""
