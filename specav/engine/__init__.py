"""The engine: requests, continuous batching, and the step loop."""
