"""Serving engine: requests, the scheduler, and the runner that executes its decisions."""
