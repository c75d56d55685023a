"""doctor package."""
