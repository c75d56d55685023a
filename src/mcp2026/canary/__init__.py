"""canary package."""
